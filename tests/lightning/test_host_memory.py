"""Host memory between steps (issue 16's 15 GB agent run): ``trim_host_memory`` gives glibc's free heap pages back,
the modules call it after every optimizer step and every validation loop on the CPU, and log the resident figures."""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import sys
import textwrap
from functools import partial

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger

import lit_llm.lightning.module as module_mod
from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.host_memory import host_peak_rss_bytes, host_rss_bytes
from lit_llm.lightning.sft import SFTModule

linux_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                 reason="malloc_trim is glibc's (Linux)")


@linux_glibc
def test_trim_returns_freed_heap_pages():
    # A fresh interpreter: 256 MiB of 64 KiB malloc blocks (below glibc's initial 128 KiB mmap threshold, so they come
    # from the heap), all freed but the last (which pins the heap top: plain free() cannot shrink it). The freed
    # pages stay resident until malloc_trim(0) returns them.
    code = textwrap.dedent("""
        import ctypes
        from lit_llm.lightning.host_memory import host_rss_bytes, trim_host_memory
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        blocks = []
        for _ in range(4096):
            p = libc.malloc(65536); libc.memset(p, 1, 65536); blocks.append(p)
        for p in blocks[:-1]:
            libc.free(p)
        held = host_rss_bytes()
        assert trim_host_memory() is True
        print(held, host_rss_bytes())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    held, after = map(int, out.stdout.split())
    assert held - after > 200 * 2**20, (held, after)


def test_rss_figures_are_plausible():
    rss, peak = host_rss_bytes(), host_peak_rss_bytes()
    if rss is None or peak is None:
        pytest.skip("no procfs / getrusage on this platform")
    # ru_maxrss is sampled by the kernel and can trail the current figure by a few pages (the module logs the max)
    assert 10 * 2**20 < rss < 1024 * 2**30 and 10 * 2**20 < peak < 1024 * 2**30


ROWS = [{"prompt": f"Say {w}.", "completion": f"{w} {w} {w}"} for w in ("yes", "no", "blue", "red", "one", "two")]


@pytest.mark.parametrize("growth", [0.0, 1e9])
def test_sft_module_releases_host_memory_after_steps_and_validation(tmp_path, tokenizer, monkeypatch, growth):
    # a steady resident set; the first step only sets the step site's mark; growth 0: a release after every later
    # step; a large growth: none after a step (each validation releases, always)
    calls: list[str] = []
    monkeypatch.setattr(module_mod, "host_rss_bytes", lambda: 2**30)

    def fake_trim() -> bool:
        calls.append("trim")
        return True

    monkeypatch.setattr(module_mod, "trim_host_memory", fake_trim)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    torch.manual_seed(0)
    module = SFTModule("tiny", optimizer=partial(torch.optim.SGD, lr=0.1))
    module.host_memory_release_growth = growth
    module._trimmed_at["step"] = 1  # a mark left by an earlier fit (it would make step 1 release): dropped at fit start
    dm = SFTDataModule(str(path), batch_size=2, micro_batch_size=2, val_fraction=0.34)
    dm.tokenizer = tokenizer

    class Count(Callback):
        def __init__(self) -> None:
            self.steps = self.validations = 0

        def on_train_batch_end(self, *args: object) -> None:
            self.steps += 1

        def on_validation_end(self, *args: object) -> None:
            self.validations += 1

    count = Count()
    trainer = Trainer(max_steps=3, val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                      logger=CSVLogger(tmp_path, name="csv", version=0), log_every_n_steps=1, callbacks=[count],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", devices=1)
    trainer.fit(module, dm)
    assert count.steps == 3 and count.validations >= 1
    assert len(calls) == (count.steps - 1 if growth == 0 else 0) + count.validations
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    logged = [r for r in rows if r.get("memory/host_rss_gib")]
    if host_rss_bytes() is not None:
        assert len(logged) == 3
        assert all(0 < float(r["memory/host_rss_gib"]) <= float(r["memory/host_peak_rss_gib"]) for r in logged)


def test_release_follows_the_growth_of_the_resident_set(monkeypatch):
    # a site's first call only sets its mark; then it releases once the resident set is >= 1.2x (the default growth)
    # the mark, which becomes the size just before that release: 5.0 (mark 5.0), 5.9 (< 6.0), 6.1 (>= 6.0: release,
    # mark 6.1), 7.2 (< 7.32), 7.4 (release, mark 7.4), 7.0; force always releases
    calls: list[str] = []
    rss = {"gib": 0.0}
    monkeypatch.setattr(module_mod, "trim_host_memory", lambda: calls.append(f"trim {rss['gib']}") or True)
    monkeypatch.setattr(module_mod, "host_rss_bytes", lambda: int(rss["gib"] * 2**30))
    module = SFTModule("tiny")
    assert module.host_memory_release_growth == 0.2
    for gib in (5.0, 5.9, 6.1, 7.2, 7.4, 7.0):
        rss["gib"] = gib
        figures = module.release_host_memory()
        assert figures["memory/host_rss_gib"] == pytest.approx(gib)
    assert calls == ["trim 6.1", "trim 7.4"]
    calls.clear()
    module.release_host_memory(force=True, site="validation")
    module.release_host_memory(force=True, site="validation")
    assert calls == ["trim 7.0"] * 2


def test_rollout_release_follows_the_rollouts_own_growth(monkeypatch):
    # the rollout site's mark is the resident set at the last step's end (after its release, if any): it releases
    # only when the rollout grew the process by 20% since then, not for the free blocks the last loss left (which the
    # next loss reuses); a release here takes the resident set to 2.0 GiB
    calls: list[str] = []
    rss = {"gib": 0.0}

    def trim() -> bool:
        calls.append(f"trim {rss['gib']}")
        rss["gib"] = 2.0
        return True

    monkeypatch.setattr(module_mod, "trim_host_memory", trim)
    monkeypatch.setattr(module_mod, "host_rss_bytes", lambda: int(rss["gib"] * 2**30))
    module = SFTModule("tiny")
    for site, gib in [("rollout", 1.2),  # the site's first call: its mark, kept
                      ("step", 5.0),  # the site's first call: its mark, kept; the rollout's mark: 5.0
                      ("rollout", 6.2),  # 6.2 >= 1.2 x 5.0: release (to 2.0)
                      ("step", 5.3),  # < 1.2 x 5.0: kept; the rollout's mark: 5.3
                      ("rollout", 6.3),  # < 1.2 x 5.3: kept
                      ("step", 5.4),  # kept; the rollout's mark: 5.4
                      ("rollout", 7.0),  # >= 1.2 x 5.4: release
                      ("step", 6.1)]:  # >= 1.2 x 5.0: release (to 2.0; the rollout's mark: 2.0)
        rss["gib"] = gib
        module.release_host_memory(site=site)
    assert calls == ["trim 6.2", "trim 7.0", "trim 6.1"]
    assert module._trimmed_at == {"step": int(6.1 * 2**30), "rollout": 2 * 2**30}


def test_release_is_skipped_off_the_cpu(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(module_mod, "trim_host_memory", lambda: calls.append("trim") or True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    module = SFTModule("tiny")
    monkeypatch.setattr(type(module), "device", property(lambda self: torch.device("cuda", 0)))
    figures = module.release_host_memory()
    assert calls == []
    if host_rss_bytes() is not None:
        assert set(figures) == {"memory/host_rss_gib", "memory/host_peak_rss_gib", "memory/cuda_allocated_gib",
                                "memory/cuda_peak_gib"}


@pytest.mark.parametrize(("growth", "arenas", "keep"), [(0.0, 1, True), (1e9, 1, True), (0.0, None, False)])
def test_grpo_tunes_malloc_at_fit_start_and_releases_around_the_loss(monkeypatch, growth, arenas, keep):
    # a steady resident set; at fit start the arenas are capped (host_malloc_arenas; None: left alone) and malloc
    # keeps freed pages (host_malloc_keep_freed_pages); each site's first call only sets its mark; with growth 0 a
    # release after taking each later rollout, before its loss, and after each later step; with a large growth none
    # (the rollout's mark is the step's end: a steady run does not grow)
    monkeypatch.setattr(module_mod, "host_rss_bytes", lambda: 2**30)
    from lit_llm.lightning.grpo import GRPOModule
    from lit_llm.lightning.grpo_data import GRPODataModule

    events: list[str] = []
    monkeypatch.setattr(module_mod, "trim_host_memory", lambda: events.append("trim") or True)
    monkeypatch.setattr(module_mod, "limit_malloc_arenas", lambda n: events.append(f"arenas {n}") or True)
    monkeypatch.setattr(module_mod, "keep_freed_pages", lambda: events.append("keep") or True)
    real_loss = GRPOModule.micro_batch_loss

    def loss(self, mb, normalizer):
        events.append("loss")
        return real_loss(self, mb, normalizer)

    monkeypatch.setattr(GRPOModule, "micro_batch_loss", loss)
    module = GRPOModule("tiny", reward_funcs=[lambda completions, **kw: [float(len(c)) for c in completions]],
                        num_generations=2, max_new_tokens=3, micro_batch_size=4, log_samples_every=0)
    assert (module.host_malloc_arenas, module.host_malloc_keep_freed_pages) == (1, True)  # the defaults: case 1
    module.host_memory_release_growth = growth
    module.host_malloc_arenas = arenas
    module.host_malloc_keep_freed_pages = keep
    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0)
    trainer.fit(module, GRPODataModule(batch_size=2, num_train=8, num_eval=0))
    start = (["arenas 1"] if arenas else []) + (["keep"] if keep else [])
    if growth == 0:  # step 2: the rollout's release, the loss of its one micro-batch, the step's release
        assert events == [*start, "loss", "trim", "loss", "trim"]
    else:
        assert events == [*start, "loss", "loss"]


@linux_glibc
@pytest.mark.parametrize("cap", [True, False])
def test_limit_malloc_arenas_makes_new_threads_share_the_arena(cap):
    # A fresh interpreter: a thread started after limit_malloc_arenas(1) mallocs from an existing arena; without the
    # cap glibc gives it one of its own. glibc's malloc_stats() prints one "Arena N:" block per arena (to stderr).
    code = textwrap.dedent(f"""
        import ctypes, os, threading
        from lit_llm.lightning.host_memory import limit_malloc_arenas
        if {cap}:
            assert limit_malloc_arenas(1) is True
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        def work():
            for p in [libc.malloc(4096) for _ in range(1000)]:
                libc.free(p)
        libc.malloc_stats()
        os.write(2, b"--- thread\\n")
        t = threading.Thread(target=work)
        t.start()
        t.join()
        libc.malloc_stats()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = out.stderr.split("--- thread")
    grew = after.count("Arena ") - before.count("Arena ")
    assert grew == (0 if cap else 1), out.stderr


@linux_glibc
@pytest.mark.parametrize("keep", [True, False])
def test_keep_freed_pages_keeps_a_large_freed_block_resident_for_reuse(keep):
    # A fresh interpreter: a 64 MiB block (above glibc's mmap threshold: by default it gets its own mmap, which free()
    # unmaps) is written, freed and allocated again. With keep_freed_pages() it comes from the heap, free() leaves its
    # pages resident and the second allocation faults none in; without, free() drops 64 MiB and the second one faults
    # in its pages again. trim_host_memory() still returns kept pages. The child gets no malloc settings of its own
    # (GLIBC_TUNABLES, MALLOC_*, a preloaded allocator) from this process's environment.
    code = textwrap.dedent(f"""
        import ctypes, resource
        from lit_llm.lightning.host_memory import host_rss_bytes, keep_freed_pages, trim_host_memory
        if {keep}:
            assert keep_freed_pages() is True
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        size = 64 * 2**20
        p = libc.malloc(size); libc.memset(p, 1, size)
        written = host_rss_bytes()
        libc.free(p)
        freed = host_rss_bytes()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(size); libc.memset(p, 1, size)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        libc.free(p)
        trim_host_memory()
        print(written - freed, faults, written - host_rss_bytes())
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "LD_PRELOAD") and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    dropped_by_free, faults, dropped_by_trim = map(int, out.stdout.split())
    if keep:
        assert dropped_by_free < 2**20 and faults < 256 and dropped_by_trim > 60 * 2**20, out.stdout
    else:  # the page count depends on the page size (transparent huge pages): the drop on free() does not
        assert dropped_by_free > 60 * 2**20 and faults > 0, out.stdout


def test_limit_malloc_arenas_rejects_less_than_one():
    from lit_llm.lightning.host_memory import limit_malloc_arenas

    with pytest.raises(ValueError, match=r"arenas=0 must be at least 1"):
        limit_malloc_arenas(0)


def test_cuda_memory_figures_on_cuda_only(monkeypatch):
    # stand-in torch.cuda counters (no GPU here): read for the module's own device, in GiB; never on the CPU
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: calls.append(("allocated", device)) or
                        3 * 2**29)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append(("peak", device)) or
                        5 * 2**30)
    module = SFTModule("tiny")
    assert not [k for k in module.release_host_memory() if k.startswith("memory/cuda")]
    assert calls == []
    monkeypatch.setattr(type(module), "device", property(lambda self: torch.device("cuda", 1)))
    figures = module.release_host_memory()
    assert (figures["memory/cuda_allocated_gib"], figures["memory/cuda_peak_gib"]) == (1.5, 5.0)
    assert calls == [("allocated", torch.device("cuda", 1)), ("peak", torch.device("cuda", 1))]


@pytest.mark.parametrize("config", ["grpo_tiny.yaml", "sft_tiny.yaml"])
def test_shipped_configs_tune_malloc_once_at_fit_start(tmp_path, monkeypatch, config):
    # the shipped tiny configs as they are (1 step): the arena cap and the kept freed pages are each applied once, at
    # fit start, by the module's defaults (no config sets them)
    from pathlib import Path

    from lit_llm.lightning.cli import main

    calls: list[str] = []
    monkeypatch.setattr(module_mod, "limit_malloc_arenas", lambda n: calls.append(f"arenas {n}") or True)
    monkeypatch.setattr(module_mod, "keep_freed_pages", lambda: calls.append("keep") or True)
    root = Path(__file__).resolve().parents[2]
    main(["fit", "--config", str(root / "configs" / config), "--trainer.max_steps", "1",
          "--trainer.num_sanity_val_steps", "0", "--trainer.default_root_dir", str(tmp_path),
          "--trainer.enable_progress_bar", "false"])
    assert calls == ["arenas 1", "keep"]
