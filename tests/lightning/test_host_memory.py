"""Host memory between steps (issue 16's 15 GB agent run): ``trim_host_memory`` gives glibc's free heap pages back,
the modules call it after every optimizer step and every validation loop on the CPU, and log the resident figures."""

from __future__ import annotations

import csv
import json
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
    # a steady resident set; growth 0: after every step; a large growth: after the first step only (then each
    # validation, always)
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
    assert len(calls) == (count.steps if growth == 0 else 1) + count.validations
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    logged = [r for r in rows if r.get("memory/host_rss_gib")]
    if host_rss_bytes() is not None:
        assert len(logged) == 3
        assert all(0 < float(r["memory/host_rss_gib"]) <= float(r["memory/host_peak_rss_gib"]) for r in logged)


def test_release_follows_the_growth_of_the_resident_set(monkeypatch):
    # each site releases at its first call, then only once the resident set is >= 1.1x its size just before that
    # site's last release: 5.0 (release, mark 5.0), 5.3 (< 5.5), 6.0 (>= 5.5: release, mark 6.0), 5.9, 6.5 (< 6.6),
    # 6.7 (release); force always releases
    calls: list[str] = []
    rss = {"gib": 0.0}
    monkeypatch.setattr(module_mod, "trim_host_memory", lambda: calls.append(f"trim {rss['gib']}") or True)
    monkeypatch.setattr(module_mod, "host_rss_bytes", lambda: int(rss["gib"] * 2**30))
    module = SFTModule("tiny")
    for gib in (5.0, 5.3, 6.0, 5.9, 6.5, 6.7):
        rss["gib"] = gib
        figures = module.release_host_memory()
        assert figures["memory/host_rss_gib"] == pytest.approx(gib)
    assert calls == ["trim 5.0", "trim 6.0", "trim 6.7"]
    calls.clear()
    module.release_host_memory(force=True, site="validation")
    module.release_host_memory(force=True, site="validation")
    assert calls == ["trim 6.7"] * 2


def test_rollout_release_follows_the_rollouts_own_growth(monkeypatch):
    # the rollout site's mark is the resident set at the last step's end (after its release, if any): it releases
    # only when the rollout grew the process by 10% since then, not for the free blocks the last loss left (which the
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
    for site, gib in [("rollout", 1.2),  # the site's first call: release
                      ("step", 5.0),  # the site's first call: release (to 2.0; the rollout's mark: 2.0)
                      ("rollout", 2.6),  # 2.6 >= 1.1 x 2.0: release
                      ("step", 5.3),  # < 1.1 x 5.0: kept; the rollout's mark: 5.3
                      ("rollout", 5.4),  # < 1.1 x 5.3: kept
                      ("step", 5.4),  # kept; the rollout's mark: 5.4
                      ("rollout", 7.0)]:  # >= 1.1 x 5.4: release
        rss["gib"] = gib
        module.release_host_memory(site=site)
    assert calls == ["trim 1.2", "trim 5.0", "trim 2.6", "trim 7.0"]


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


@pytest.mark.parametrize(("growth", "arenas"), [(0.0, 1), (1e9, 1), (0.0, None)])
def test_grpo_caps_the_arenas_at_fit_start_and_releases_around_the_loss(monkeypatch, growth, arenas):
    # a steady resident set; at fit start the arenas are capped (host_malloc_arenas; None: left alone); a release
    # after taking each rollout, before its loss, and after each step with growth 0; with a large growth each site
    # releases at its first call only (the rollout's mark is then the step's end: a steady run does not grow)
    monkeypatch.setattr(module_mod, "host_rss_bytes", lambda: 2**30)
    from lit_llm.lightning.grpo import GRPOModule
    from lit_llm.lightning.grpo_data import GRPODataModule

    events: list[str] = []
    monkeypatch.setattr(module_mod, "trim_host_memory", lambda: events.append("trim") or True)
    monkeypatch.setattr(module_mod, "limit_malloc_arenas", lambda n: events.append(f"arenas {n}") or True)
    real_loss = GRPOModule.micro_batch_loss

    def loss(self, mb, normalizer):
        events.append("loss")
        return real_loss(self, mb, normalizer)

    monkeypatch.setattr(GRPOModule, "micro_batch_loss", loss)
    module = GRPOModule("tiny", reward_funcs=[lambda completions, **kw: [float(len(c)) for c in completions]],
                        num_generations=2, max_new_tokens=3, micro_batch_size=4, log_samples_every=0)
    module.host_memory_release_growth = growth
    module.host_malloc_arenas = arenas
    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0)
    trainer.fit(module, GRPODataModule(batch_size=2, num_train=8, num_eval=0))
    start = ["arenas 1"] if arenas else []
    if growth == 0:  # per step: the rollout's release, the loss of its one micro-batch, the step's release
        assert events == [*start, "trim", "loss", "trim", "trim", "loss", "trim"]
    else:
        assert events == [*start, "trim", "loss", "trim", "loss"]


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
