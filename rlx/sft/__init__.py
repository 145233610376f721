"""`rlx sft`: supervised fine-tuning on JSONL conversations, the loss on the assistant's tokens only.

A stage of its own (e.g. a warm start that teaches a model to call tools before RL); its output
folder is a model `rlx train` starts from with `model.path`. Data format and masking: docs/sft.md.
"""

from rlx.sft.config import SFTConfig, load_sft_config
from rlx.sft.data import Conversation, MaskedTokens, encode_conversations, load_conversations, load_sft_data
from rlx.sft.train import collate_masked, masked_nll, run_sft

__all__ = ["Conversation", "MaskedTokens", "SFTConfig", "collate_masked",
           "encode_conversations", "load_conversations", "load_sft_config", "load_sft_data", "masked_nll", "run_sft"]
