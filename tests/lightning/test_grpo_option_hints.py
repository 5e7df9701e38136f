"""Every CLI option the GRPO / episode code names in its messages exists: ``--model[.init_args].X`` /
``model.X`` must be a GRPOModule parameter and ``--data[.init_args].X`` / ``data.X`` a GRPODataModule one (a hint
naming an option that does not exist sends the user to an error of its own)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule

ROOT = Path(__file__).resolve().parents[2]
FILES = ["lit_llm/lightning/grpo.py", "lit_llm/lightning/grpo_data.py", "lit_llm/lightning/grpo_eval.py",
         "lit_llm/lightning/episode_metrics.py", "lit_llm/data/tool_calls.py",
         *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "lit_llm" / "rewards").rglob("*.py")),
         *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "lit_llm" / "rollouts").rglob("*.py"))]
#: ``model.X`` / ``data.X`` not preceded by a word or a dot (``self.model.config``, ``lit_llm.data.history`` are not
#: options)
OPTION = re.compile(r"(?<![\w.])(?:--)?(model|data)\.(?:init_args\.)?([a-z_]+)")


def test_option_hints_name_existing_options():
    known = {"model": set(inspect.signature(GRPOModule).parameters),
             "data": set(inspect.signature(GRPODataModule).parameters)}
    found, wrong = 0, []
    for name in FILES:
        for i, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            for group, option in OPTION.findall(line):
                found += 1
                if option not in known[group]:
                    wrong.append(f"{name}:{i}: {group}.{option}")
    assert found >= 30 and not wrong, wrong  # 38 when written
