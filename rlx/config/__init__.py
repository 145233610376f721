"""The typed run config: one `RunConfig` describes a whole run.

Loaded from YAML plus dotted command-line overrides (`train.lr=1e-6`). Every section forbids
unknown keys, so a typo is an error that names the key and the keys allowed beside it. One module
per section (`data.py`, `rollout.py`, ...), each with its cross-section rules beside it; `run.py`
collects them, `load.py` reads a config. The names below are what the rest of rlx imports.
"""

from rlx.config.algorithm import (
    AlgorithmConfig,
    CispoLoss,
    ClippedLoss,
    CustomLoss,
    GspoLoss,
    LossConfig,
    SapoLoss,
    auto_correction,
    resolve_routing_replay,
)
from rlx.config.base import parse_yaml
from rlx.config.data import (
    AUDIO_SAMPLING_RATE,
    MEDIA_MODALITIES,
    SPOKEN_CACHE_DIR,
    DataConfig,
    MediaKind,
    MediaLimits,
    VideoSampling,
)
from rlx.config.faults import FaultConfig
from rlx.config.load import apply_overrides, build_config, load_config, read_yaml_mapping
from rlx.config.rollout import AgentConfig, AutoscaleConfig, EngineSettings, RolloutConfig
from rlx.config.run import RunConfig, config_warnings
from rlx.config.train import TrainConfig, lost_actor_cost
from rlx.errors import ConfigError

__all__ = [
    "AUDIO_SAMPLING_RATE", "MEDIA_MODALITIES", "SPOKEN_CACHE_DIR", "AgentConfig", "AlgorithmConfig", "AutoscaleConfig",
    "CispoLoss", "ClippedLoss", "ConfigError", "CustomLoss", "DataConfig", "EngineSettings", "FaultConfig",
    "GspoLoss", "LossConfig", "MediaKind", "MediaLimits", "RolloutConfig", "RunConfig", "SapoLoss", "TrainConfig",
    "VideoSampling", "apply_overrides", "auto_correction", "build_config", "config_warnings", "load_config",
    "lost_actor_cost", "parse_yaml", "read_yaml_mapping", "resolve_routing_replay",
]
