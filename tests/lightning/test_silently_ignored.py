"""Issue 30 item 5, "nothing silently ignored": options and rows that used to be ignored without a word are now an
error naming the option (or ``file:line``) and the fix, or a warning plus a logged count / the true value.

Unit tests (default suite) assert each exact message; the ``slow`` tests run ``lit-llm fit`` in a subprocess and
assert the first ``lit-llm: error:`` line on stderr (or the warning and what the run wrote)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch import Callback, Trainer

from lit_llm.data.chat_template import ChatTemplateError, check_template_kwargs
from lit_llm.data.rows import DataFormatError
from lit_llm.lightning import precision as precision_module
from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.grpo_data import GRPODataModule, gsm8k_prompts, prompt_rows
from lit_llm.lightning.policy_setup import check_lora_targets, linear_module_names, load_policy_model
from lit_llm.models import ModelConfig, tiny_model
from lit_llm.rollouts.dynamic_sampling import SamplingCap

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "configs/grpo_tiny.yaml")
SFT = str(ROOT / "configs/sft_tiny.yaml")
LLAMA_LINEAR = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def attach(dm, tokenizer, *, context: int, max_new_tokens: int = 8, **module_attrs):
    """Attach a stand-in module (what the data modules read of it) with a model of ``context`` positions."""
    module = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context)),
                             max_new_tokens=max_new_tokens, eval_max_new_tokens=max_new_tokens, tokenizer=tokenizer,
                             chat_template=None, chat_template_kwargs={}, **module_attrs)
    dm.tokenizer = tokenizer
    dm.trainer = SimpleNamespace(lightning_module=module, loggers=[])
    return dm


# ------------------------------------------------------------------------------------ 1. lora_target_modules
def test_a_lora_target_that_matches_nothing_is_named(tokenizer):
    model = tiny_model(tokenizer)
    assert linear_module_names(model) == LLAMA_LINEAR.split(", ")  # the head (lm_head) is left out
    with pytest.raises(ValueError) as e:
        check_lora_targets(model, ["q_proj", "vproj"])
    assert str(e.value) == (
        "--model.init_args.lora_target_modules: 'vproj' matches no module of the model, so it would get no adapter. "
        f"The model's linear layers are: {LLAMA_LINEAR}. Fix: name some of these, or use [all-linear].")
    with pytest.raises(ValueError, match=r"^--model\.init_args\.lora_target_modules: 'qproj', 'self_attn\.vproj' "
                                         r"match no module of the model, so they would get no adapter\."):
        check_lora_targets(model, ["qproj", "self_attn.vproj"])
    for fine in (None, ["all-linear"], ["q_proj", "self_attn.v_proj", "mlp.down_proj"]):
        check_lora_targets(model, fine)  # names and dotted suffixes, as peft matches them


def test_load_policy_model_refuses_the_missing_target_before_peft():
    with pytest.raises(ValueError, match=r"^--model\.init_args\.lora_target_modules: 'vproj' matches no module"):
        load_policy_model(ModelConfig("tiny", use_peft=True, lora_target_modules=["q_proj", "vproj"]))


# ------------------------------------------------------------------------------------ 2. rename_columns
def test_rename_columns_from_a_missing_column_is_named(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "1 + 1?", "sol": "2"}] * 3)
    with pytest.raises(DataFormatError) as e:
        prompt_rows(str(path), rename_columns={"questoin": "prompt", "sol": "answer"})
    assert str(e.value) == (f"--data.rename_columns renames column 'questoin' to 'prompt', but {path} has no column "
                            f"'questoin' (its columns: ['question', 'sol']). Fix: use one of its columns as the key.")
    # GSM8K's own renaming is named as the task's
    with pytest.raises(DataFormatError, match=r"^--data\.task gsm8k renames column 'question' to 'prompt', but "):
        gsm8k_prompts(str(write_jsonl(tmp_path / "g.jsonl", [{"q": "1 + 1?", "answer": "#### 2"}])))
    assert [r["prompt"] for r in prompt_rows(str(path), rename_columns={"question": "prompt"})] == ["1 + 1?"] * 3


def test_rename_columns_onto_an_existing_column_is_named(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "1 + 1?", "prompt": "x", "sol": "2"}])
    with pytest.raises(DataFormatError) as e:
        prompt_rows(str(path), rename_columns={"question": "prompt"})
    assert str(e.value) == (f"--data.rename_columns renames column 'question' to 'prompt', but {path} also has "
                            f"column 'prompt': one would silently replace the other (its columns: ['prompt', "
                            f"'question', 'sol']). Fix: rename or drop one of them.")
    with pytest.raises(DataFormatError, match=r"also has column 'sol' \(also renamed to 'prompt'\)"):
        prompt_rows(str(path), rename_columns={"question": "prompt", "sol": "prompt", "prompt": "p"})


def test_the_module_names_the_rename_option(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "q.jsonl", [{"q": f"{i} + 1?", "a": str(i + 1)} for i in range(4)])
    dm = attach(GRPODataModule(path=str(path), rename_columns={"question": "prompt"}, num_eval=0, batch_size=2),
                tokenizer, context=2048)
    with pytest.raises(DataFormatError, match=r"^--data\.rename_columns renames column 'question' to 'prompt', but "):
        dm.setup("fit")


# ------------------------------------------------------------------------------------ 3. chat_template_kwargs
def test_a_misspelled_template_variable_is_named_with_a_suggestion(templates_dir):
    qwen3 = (templates_dir / "stock-qwen3.jinja").read_text()
    with pytest.raises(ChatTemplateError) as e:
        check_template_kwargs(qwen3, {"enable_thinkng": False}, template_name="stock-qwen3.jinja")
    assert str(e.value) == (
        "--model.init_args.chat_template_kwargs: the chat template (stock-qwen3.jinja) never reads 'enable_thinkng', "
        "so it would be ignored; it reads enable_thinking. Did you mean 'enable_thinking'? Fix: use one of its "
        "variables, or drop the key.")
    check_template_kwargs(qwen3, {"enable_thinking": False, "bos_token": "<s>"}, template_name="q")  # read / standard


def test_the_listed_variables_leave_out_the_templates_per_message_ones(templates_dir):
    """Loop targets (``message``, ``loop``) and variables set only inside a loop (Qwen3's ``content``) are the
    template's own; a variable set at the top level when not given (Llama 3.1's ``date_string``) is an option."""
    from lit_llm.data.chat_template import loop_variables

    qwen3 = (templates_dir / "stock-qwen3.jinja").read_text()
    assert {"message", "loop", "content", "reasoning_content"} <= loop_variables(qwen3)
    assert "enable_thinking" not in loop_variables(qwen3)
    llama = (templates_dir / "stock-llama3_1.jinja").read_text()
    with pytest.raises(ChatTemplateError) as e:
        check_template_kwargs(llama, {"date_strng": "1 Jan"}, template_name="stock-llama3_1.jinja")
    assert str(e.value) == (
        "--model.init_args.chat_template_kwargs: the chat template (stock-llama3_1.jinja) never reads 'date_strng', "
        "so it would be ignored; it reads builtin_tools, custom_tools, date_string, first_user_message, "
        "system_message, tools_in_user_message. Did you mean 'date_string'? Fix: use one of its variables, or drop "
        "the key.")


def test_kwargs_a_template_never_reads_are_refused_at_data_setup(tmp_path, tokenizer):
    """SmolLM2's own template reads no variable of its own: ``enable_thinking`` would do nothing."""
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "hi", "completion": "yo"}])
    dm = attach(SFTDataModule(str(path), loss_head="sft"), tokenizer, context=2048)
    dm.trainer.lightning_module.chat_template_kwargs = {"enable_thinking": False, "xml_tools": []}
    with pytest.raises(ChatTemplateError) as e:
        dm.setup("fit")
    assert str(e.value) == (
        "--model.init_args.chat_template_kwargs: the chat template (tokenizer default) never reads 'enable_thinking' "
        "(also unread: 'xml_tools'), so it would be ignored; it reads no variable besides the standard ones "
        "(messages, add_generation_prompt, tools, ...). Fix: use one of its variables, or drop the key.")


# ------------------------------------------------------------------------------------ 4. length budget at setup
def test_a_prompt_over_the_context_is_named_at_grpo_setup(tmp_path, tokenizer):
    long = " a" * 60
    n = len(tokenizer(long, add_special_tokens=False)["input_ids"])
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    rows[3]["prompt"] = long
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    dm = attach(GRPODataModule(path=str(path), num_eval=0, batch_size=2), tokenizer, context=64)
    with pytest.raises(DataFormatError) as e:
        dm.setup("fit")
    assert str(e.value) == (f"{path}:4: the prompt has {n} tokens; with max_new_tokens=8 it exceeds the model's "
                            f"context of 64 tokens. Fix: shorten the row, set --data.max_prompt_length 56 (drops "
                            f"longer prompts, counted), lower --model.init_args.max_new_tokens, or set "
                            f"--data.on_bad_row skip.")
    skip = attach(GRPODataModule(path=str(path), num_eval=0, batch_size=2, on_bad_row="skip"), tokenizer, context=64)
    skip.setup("fit")
    assert (len(skip.train_rows), skip.num_skipped_long, skip.num_dropped_long) == (5, 1, 0)
    assert f"{path}:4" not in [r["sample_id"] for r in skip.train_rows]
    dropped = attach(GRPODataModule(path=str(path), num_eval=0, batch_size=2, max_prompt_length=56), tokenizer,
                     context=64)
    dropped.setup("fit")  # max_prompt_length drops it first (counted), as before
    assert (len(dropped.train_rows), dropped.num_skipped_long, dropped.num_dropped_long) == (5, 0, 1)


def test_an_sft_row_over_the_context_is_named_at_setup(tmp_path, tokenizer):
    rows = [{"prompt": f"What is {i} + 1?", "completion": f"{i + 1}"} for i in range(4)]
    rows[1]["completion"] = " a" * 200
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    dm = attach(SFTDataModule(str(path), loss_head="sft", max_length=100), tokenizer, context=64)
    with pytest.raises(DataFormatError) as e:
        dm.setup("fit")
    assert str(e.value) == (f"{path}:2: 100 tokens (cut to --data.max_length 100), more than the model's context of "
                            f"64 tokens: set --data.max_length 64 (or lower) to truncate such rows, keeping the start. "
                            f"Fix the row, or set --data.on_bad_row skip.")
    skip = attach(SFTDataModule(str(path), loss_head="sft", max_length=100, on_bad_row="skip"), tokenizer, context=64)
    skip.setup("fit")
    assert (len(skip.train_samples), skip.num_skipped_rows) == (3, 1)


# ------------------------------------------------------------------------------------ 5. dynamic sampling cap
def test_sampling_cap_counts_and_warns_on_the_1st_10th_100th_step():
    cap = SamplingCap()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cap.update(found=4, num_groups=4, rounds=1, max_rounds=3, step=0) is False
        assert cap.update(found=0, num_groups=4, rounds=3, max_rounds=3, step=1) is True
        for step in range(2, 10):
            cap.update(found=1, num_groups=4, rounds=3, max_rounds=3, step=step)
        cap.update(found=2, num_groups=4, rounds=2, max_rounds=3, step=10)
    assert cap.count == 10
    assert [str(w.message) for w in caught] == [
        "dynamic sampling reached max_sampling_rounds=3 at step 1 with 0 of 4 groups informative (rewards not all "
        "equal): so its policy-gradient loss is 0 (all advantages 0). 1 such step(s) so far, logged as "
        "train/sampling_cap_reached. Fix: raise --model.init_args.max_sampling_rounds, give partial credit in the "
        "rewards, or use easier prompts.",
        "dynamic sampling used up the epoch's prompts after 2 round(s) at step 10 with 2 of 4 groups informative "
        "(rewards not all equal): the other 2 have advantage 0. 10 such step(s) so far, logged as "
        "train/sampling_cap_reached. Fix: raise --model.init_args.max_sampling_rounds, give partial credit in the "
        "rewards, or use easier prompts."]


class Recorder(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_a_grpo_step_without_informative_groups_is_warned_and_counted(one_thread):
    from lit_llm.lightning.grpo import GRPOModule

    module = GRPOModule("tiny", reward_funcs=[lambda completions, **kw: [1.0] * len(completions)], num_generations=2,
                        max_new_tokens=2, dynamic_sampling=True, max_sampling_rounds=2, log_samples_every=0)
    rec = Recorder()
    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[rec],
                      num_sanity_val_steps=0, limit_val_batches=0)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(module, GRPODataModule(batch_size=2, num_train=40, num_eval=0))
    ours = [str(w.message) for w in caught if str(w.message).startswith("dynamic sampling")]
    assert ours == ["dynamic sampling reached max_sampling_rounds=2 at step 0 with 0 of 2 groups informative "
                    "(rewards not all equal): so its policy-gradient loss is 0 (all advantages 0). 1 such step(s) so "
                    "far, logged as train/sampling_cap_reached. Fix: raise --model.init_args.max_sampling_rounds, "
                    "give partial credit in the rewards, or use easier prompts."]
    assert [s["train/sampling_cap_reached"] for s in rec.steps] == [1.0, 2.0]
    assert [s["train/sampling_rounds"] for s in rec.steps] == [2.0, 2.0]


# ------------------------------------------------------------------------------------ 6. 16-mixed on the CPU
def test_16_mixed_on_the_cpu_resolves_to_what_runs(monkeypatch):
    monkeypatch.setattr(precision_module, "bf16_support", lambda accelerator: (False, "CPU X"))
    for value in ("16-mixed", "16", 16):
        with pytest.warns(UserWarning) as caught:
            precision, line = precision_module.explain_precision(value, "cpu")
        assert precision == "bf16-mixed"
        assert line == f"precision: {value} -> bf16-mixed (no fp16 AMP on the CPU; auto would choose 32-true: CPU X)"
        assert [str(w.message) for w in caught] == [
            f"trainer.precision={value!r}: fp16 mixed precision (AMP) is not supported on the CPU, so the run uses "
            f"bf16-mixed without native bf16 matmuls (CPU X: slower than 32-true), as Lightning would; config.yaml and "
            f"the precision hyperparameter say bf16-mixed. Set --trainer.precision auto, 32-true or bf16-mixed to "
            f"choose explicitly."]
    monkeypatch.setattr(precision_module, "bf16_support", lambda accelerator: (True, "CPU with AMX"))
    with pytest.warns(UserWarning, match=r"so the run uses bf16-mixed, as Lightning would; config\.yaml"):
        assert precision_module.resolve_precision("16-mixed", "cpu") == "bf16-mixed"
    assert precision_module.resolve_precision("16-true", "cpu") == "16-true"  # fp16 weights run on the CPU as given


# ------------------------------------------------------------------------------------ the CLI (slow)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
ENV.pop("LIT_LLM_DEBUG", None)
QUICK = ["--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false"]


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", "fit", *args, "--trainer.default_root_dir",
                           str(cwd / "run"), *QUICK], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


def first_error(proc: subprocess.CompletedProcess) -> str:
    """The one ``lit-llm: error:`` line (Lightning's info lines may come before it); exit 2, no traceback."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lit-llm: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def warning(stderr: str, start: str) -> str:
    """The one warning on ``stderr`` whose message begins with ``start``, without its ``file:line:`` prefix."""
    (line,) = [line for line in stderr.splitlines() if f": {start}" in line]
    return line[line.index(f": {start}") + 2:]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    prompts = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    prompts[5]["prompt"] = " ".join(["word"] * 3000)
    write_jsonl(tmp_path / "long.jsonl", prompts)
    write_jsonl(tmp_path / "q.jsonl", [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)])
    sft = [{"prompt": f"What is {i} + 1?", "completion": str(i + 1)} for i in range(8)]
    sft[2]["completion"] = "word " * 3000
    write_jsonl(tmp_path / "s.jsonl", sft)
    return tmp_path


CLI_CASES = {
    "lora_target": (["--config", SFT, "--model.init_args.use_peft", "true", "--model.init_args.lora_target_modules",
                     "[q_proj, vproj]"],
                    "lit-llm: error: --model.init_args.lora_target_modules: 'vproj' matches no module of the model, "
                    f"so it would get no adapter. The model's linear layers are: {LLAMA_LINEAR}. Fix: name some of "
                    "these, or use [all-linear]."),
    "rename_columns": (["--config", GRPO, "--data.task", "null", "--data.path", "q.jsonl", "--data.rename_columns",
                        '{"questoin": "prompt"}'],
                       "lit-llm: error: --data.rename_columns renames column 'questoin' to 'prompt', but q.jsonl has "
                       "no column 'questoin' (its columns: ['answer', 'question']). Fix: use one of its columns as "
                       "the key."),
    "template_kwargs": (["--config", SFT, "--model.init_args.chat_template",
                         str(ROOT / "tests/fixtures/chat_templates/stock-qwen3.jinja"),
                         "--model.init_args.chat_template_kwargs", "{enable_thinkng: false}"],
                        "lit-llm: error: --model.init_args.chat_template_kwargs: the chat template (stock-qwen3.jinja) "
                        "never reads 'enable_thinkng', so it would be ignored; it reads enable_thinking. Did you "
                        "mean 'enable_thinking'? Fix: use one of its variables, or drop the key."),
    "grpo_prompt_over_context": (["--config", GRPO, "--data.task", "null", "--data.path", "long.jsonl",
                                  "--data.num_eval", "0"],
                                 "lit-llm: error: long.jsonl:6: the prompt has 3000 tokens; with max_new_tokens=8 it "
                                 "exceeds the model's context of 2048 tokens. Fix: shorten the row, set "
                                 "--data.max_prompt_length 2040 (drops longer prompts, counted), lower "
                                 "--model.init_args.max_new_tokens, or set --data.on_bad_row skip."),
    "sft_row_over_context": (["--config", SFT, "--data.format", "auto", "--data.path", "s.jsonl",
                              "--data.max_length", "4096"],
                             "lit-llm: error: s.jsonl:3: 3000 tokens (cut to --data.max_length 4096)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_names_what_used_to_be_ignored(case, workdir, tokenizer):
    args, expected = CLI_CASES[case]
    line = first_error(run_cli(args, workdir))
    if case == "grpo_prompt_over_context":
        assert len(tokenizer(" ".join(["word"] * 3000), add_special_tokens=False)["input_ids"]) == 3000
    if case == "sft_row_over_context":  # the render adds the chat scaffold: the count is the template's
        assert line.startswith("lit-llm: error: s.jsonl:3: ") and line.endswith(
            " tokens, more than the model's context of 2048 tokens: set --data.max_length 2048 (or lower) to truncate "
            "such rows, keeping the start. Fix the row, or set --data.on_bad_row skip."), line
    else:
        assert line == expected


@pytest.mark.slow
def test_cli_dynamic_sampling_at_its_cap_warns_and_logs(workdir):
    """The tiny random model earns no strict arithmetic reward: every group is zero-std, every step hits the cap."""
    proc = run_cli(["--config", GRPO, "--model.init_args.dynamic_sampling", "true", "--trainer.num_sanity_val_steps",
                    "0", "--data.num_eval", "0"], workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert warning(proc.stderr, "dynamic sampling") == (
        "dynamic sampling reached max_sampling_rounds=3 at step 0 with 0 of 4 groups informative (rewards not all "
        "equal): so its policy-gradient loss is 0 (all advantages 0). 1 such step(s) so far, logged as "
        "train/sampling_cap_reached. Fix: raise --model.init_args.max_sampling_rounds, give partial credit in the "
        "rewards, or use easier prompts.")
    (metrics,) = (workdir / "run").rglob("metrics.csv")
    header, *rows = metrics.read_text().splitlines()
    column = header.split(",").index("train/sampling_cap_reached")
    assert [r.split(",")[column] for r in rows if r.split(",")[column]] == ["1.0"]


@pytest.mark.slow
def test_cli_16_mixed_on_the_cpu_says_bf16_mixed_everywhere(workdir):
    proc = run_cli(["--config", SFT, "--trainer.precision", "16-mixed"], workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert warning(proc.stderr, "trainer.precision=").startswith(
        "trainer.precision='16-mixed': fp16 mixed precision (AMP) is not supported on the CPU, so the run uses "
        "bf16-mixed")  # the rest depends on this CPU's bf16 support (unit test above)
    assert "precision: 16-mixed -> bf16-mixed (no fp16 AMP on the CPU; " in proc.stdout
    assert not re.search(r"(?<!bf)16-mixed", " ".join(p.read_text() for p in (workdir / "run").rglob("*.yaml")))
    (config,) = (workdir / "run").rglob("config.yaml")
    assert "  precision: bf16-mixed\n" in config.read_text()
    (hparams,) = (workdir / "run").rglob("hparams.yaml")
    assert "precision: bf16-mixed\n" in hparams.read_text()
