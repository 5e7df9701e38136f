"""Lightning layer: LightningModules, the SFT data module, callbacks, export and the ``lit-llm`` CLI."""

from lit_llm.lightning.callbacks import ValidationSamples
from lit_llm.lightning.datamodules import SFTDataModule, StepBatchLoader
from lit_llm.lightning.module import PolicyModule
from lit_llm.lightning.sft import SFTModule

__all__ = ["PolicyModule", "SFTDataModule", "SFTModule", "StepBatchLoader", "ValidationSamples"]
