"""Moved to :mod:`lit_llm.plot` (it needs no Lightning): this module re-exports its public names for old imports and
keeps ``python -m lit_llm.lightning.plot LOG_DIR`` working."""

import sys

from lit_llm.plot import (
    IGNORED,
    PANEL_SPECS,
    CurvesPlot,
    PanelSpec,
    Series,
    collect_panels,
    command,
    find_metrics_files,
    load_metrics,
    main,
    panel_for,
    plot_training_curves,
)

__all__ = ["IGNORED", "PANEL_SPECS", "CurvesPlot", "PanelSpec", "Series", "collect_panels", "command",
           "find_metrics_files", "load_metrics", "main", "panel_for", "plot_training_curves"]

if __name__ == "__main__":
    sys.exit(main())
