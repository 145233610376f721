"""The typed run config: one `RunConfig` describes a whole run.

Loaded from YAML plus dotted command-line overrides (`train.lr=1e-6`). Every section forbids
unknown keys, so a typo is an error that names the key and the keys allowed beside it.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from rlx.errors import ConfigError
from rlx.generation_engines import GENERATION_ENGINES
from rlx.model_kinds import ROUTE_REPORTING_ENGINES, is_moe_model


class _Yaml12Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-6` as a string; accept YAML 1.2 floats so free-form dicts get numbers too."""


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12Loader)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str = Field("smollm2-135m-instruct", description="a built-in model name (`rlx models list`) or a HF folder")


MEDIA_MODALITIES = ("image", "audio", "video")
AUDIO_SAMPLING_RATE = 16_000  # Hz: Whisper's and Relax's
DIGITS_EVAL_SIZE = 500  # the digits' held-out default: 500 of its 1797 images
SPOKEN_CACHE_DIR = Path.home() / ".cache" / "rlx" / "data" / "spoken_digits"  # its clips; its default media root
BUILT_IN_SIZES = {"digits": {"eval_size": DIGITS_EVAL_SIZE},  # defaults where the source's own suit it better
                  "spoken_digits": {"train_size": 1000, "eval_size": 300}}  # a clip is ~50 KB, made once


class MediaLimits(Section):
    """Bounds on the untrusted media data rows point to, checked before anything is decoded."""

    max_pixels: int = Field(16_777_216, gt=0, description="largest image (width x height), read from its header")
    max_bytes: int = Field(50_000_000, gt=0, description="largest encoded media file or inline bytes")
    max_frames: int = Field(768, gt=0, description="most frames a video yields: caps data.video.max_frames; "
                            "a frame array with more is refused")
    max_seconds: float = Field(600.0, gt=0, description="longest audio or video, read from its header before "
                               "decoding")
    root: str | None = Field(None, description="media paths must resolve (symlinks followed) inside this folder; "
                             "default: the folder of data.path")
    _data_dir: str | None = PrivateAttr(None)  # set by DataConfig: the default root

    @field_validator("root")
    @classmethod
    def _absolute(cls, root: str | None) -> str | None:
        """Absolute once, here: a process started in another working directory checks the same folder."""
        return None if root is None else str(Path(root).expanduser().resolve())

    @property
    def root_dir(self) -> Path:
        """The folder media paths must stay in: `root`, else data.path's folder, else the working directory."""
        return Path(self.root or self._data_dir or ".").resolve()


class VideoSampling(Section):
    """Frames taken from a video file: `fps` frames per second of video time, at least `min_frames`
    and at most `max_frames`, spread uniformly over the video (Qwen-VL's and Relax's defaults)."""

    fps: float = Field(2.0, gt=0, description="frames per second of video time")
    min_frames: int = Field(4, gt=0, description="frames of a short video, however short")
    max_frames: int = Field(768, gt=0, description="frames of a long video, however long (and at most "
                            "data.media_limits.max_frames)")

    @model_validator(mode="after")
    def _ordered(self) -> VideoSampling:
        if self.min_frames > self.max_frames:
            raise ValueError(f"data.video.min_frames={self.min_frames} is more than data.video.max_frames="
                             f"{self.max_frames}; lower min_frames or raise max_frames")
        return self


class DataConfig(Section):
    source: Literal["reasoning_gym", "jsonl", "parquet", "digits", "spoken_digits"] = Field(
        "reasoning_gym", description="digits: scikit-learn's 1797 8x8 digit images (pip install 'rlx[media]'); "
        "spoken_digits: numbers spoken by espeak-ng, held-out voices in eval (task_params: {task: digit|sum})")
    task: str = Field("chain_sum", description="reasoning-gym task name when source=reasoning_gym")
    task_params: dict[str, Any] = Field(default_factory=dict)
    train_size: int = Field(5000, gt=0)
    eval_size: int = Field(128, ge=0)
    path: str | None = Field(None, description="train file for jsonl/parquet")
    eval_path: str | None = Field(None, description="held-out file for jsonl/parquet")
    prompt_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str = "metadata"
    system_prompt: str | None = None
    apply_chat_template: bool = True
    max_prompt_tokens: int = Field(512, gt=0)
    seed: int = 0
    media_keys: dict[str, str] = Field(default_factory=dict, description="modality -> row key of its media, e.g. "
                                       "{image: images}; empty: text-only rows")
    media_limits: MediaLimits = Field(default_factory=MediaLimits)
    video: VideoSampling = Field(default_factory=VideoSampling)
    image_pixels: tuple[int, int] | None = Field(
        None, description="(min, max) pixels an image is resized into before patching (Qwen-VL's smart resize; "
        "each side a multiple of patch x merge); default: the model family's (Qwen2/2.5-VL 3136-1003520, "
        "Qwen3-VL 65536-16777216). More pixels: more image tokens")
    audio_sampling_rate: int = Field(AUDIO_SAMPLING_RATE, gt=0, description="audio is resampled to this rate (Hz), mono")
    processor_workers: int = Field(0, ge=0, description="processes per rollout replica that decode and process "
                                   "media, the groups a step starts in parallel; 0: on the rollout's own thread")

    @model_validator(mode="before")
    @classmethod
    def _built_in_sizes(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and raw.get("source") in BUILT_IN_SIZES:
            return {**BUILT_IN_SIZES[raw["source"]], **raw}
        return raw

    @field_validator("image_pixels")
    @classmethod
    def _pixel_bounds(cls, bounds: tuple[int, int] | None) -> tuple[int, int] | None:
        if bounds is not None and not 0 < bounds[0] <= bounds[1]:
            raise ValueError(f"data.image_pixels={list(bounds)} must be [min, max] with 0 < min <= max")
        return bounds

    @field_validator("media_keys")
    @classmethod
    def _known_modalities(cls, keys: dict[str, str]) -> dict[str, str]:
        for modality, key in keys.items():
            if modality not in MEDIA_MODALITIES:
                raise ValueError(f"{modality!r} is not a modality; use {', '.join(MEDIA_MODALITIES)}")
            if not key:
                raise ValueError(f"the row key of {modality!r} is empty; name the field that holds its media")
        return keys

    @model_validator(mode="after")
    def _file_sources_need_a_path(self) -> DataConfig:
        if self.source in ("jsonl", "parquet") and not self.path:
            raise ValueError(f"data.path is required when data.source={self.source!r}; set data.path=<file>")
        return self

    @property
    def has_media(self) -> bool:
        """Rows carry media: the run needs a media processor and the bus a media field."""
        return bool(self.media_keys) or self.source in ("digits", "spoken_digits")

    @model_validator(mode="after")
    def _default_media_root(self) -> DataConfig:
        """Media paths default to staying beside the data file, or in spoken_digits' cache (its clips are
        made under the root); absolute, like `root` (see MediaLimits)."""
        if self.source == "spoken_digits":
            self.media_limits._data_dir = str(SPOKEN_CACHE_DIR.resolve())
        else:
            self.media_limits._data_dir = str(Path(self.path).parent.resolve()) if self.path else None
        return self


class AutoscaleConfig(Section):
    """Async mode: scale the rollout on bus back-pressure. Back-pressure is the rows waiting for the
    trainer, as a fraction of what the staleness gate lets the rollout get ahead by
    ((max_staleness + 1) steps of rows), averaged over `window_s`."""

    enabled: bool = False
    min_replicas: int = Field(1, ge=1, le=16)
    max_replicas: int = Field(2, ge=1, le=16)
    window_s: float = Field(30.0, gt=0.0, description="back-pressure is averaged over this long; a change "
                            "waits this long after the last one")
    scale_up_below: float = Field(0.25, ge=0.0, description="add a replica when back-pressure is below this: "
                                  "the trainer finds little waiting, so generation is the bottleneck")
    scale_down_above: float = Field(0.75, ge=0.0, description="remove a replica when back-pressure is above this: "
                                    "the rollout runs ahead of the trainer and waits at the staleness gate")

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> AutoscaleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"rollout.autoscale.min_replicas={self.min_replicas} exceeds "
                             f"max_replicas={self.max_replicas}: raise max_replicas or lower min_replicas")
        if self.scale_up_below >= self.scale_down_above:
            raise ValueError(f"rollout.autoscale.scale_up_below={self.scale_up_below} must be below "
                             f"scale_down_above={self.scale_down_above}, or the rollout would scale both ways at once")
        return self


class EngineSettings(Section):
    """How a generation engine runs: the Rollout's and the GenRM judge's each have their own."""

    engine: str = Field("hf", description="generation engine: hf, vllm (pip install 'rlx[vllm]'), sglang, "
                        "or one registered in GENERATION_ENGINES")
    engine_options: dict[str, Any] = Field(default_factory=dict,
                                           description="backend-specific settings, passed to the engine as is "
                                           "(sglang: url, api_key, ...; vllm: EngineArgs fields, or url to drive "
                                           "a running vLLM server)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the engine's weights; training precision is train.param_dtype. For the Rollout, "
        "a dtype other than the trainer's makes algorithm.behavior_correction=auto pick tis")

    @field_validator("engine")
    @classmethod
    def _engine_is_known(cls, engine: str) -> str:
        if engine not in GENERATION_ENGINES:
            raise ValueError(f"not a generation engine; use one of {', '.join(GENERATION_ENGINES.names())}")
        return engine


class ToolConfig(Section):
    name: str = Field(description="built-in tool (calculator, python) or a user class package.module:Name")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the tool's constructor; "
                                    "python: rlx.agents.sandbox.SandboxLimits' fields and timeout_s "
                                    "(allow_unsandboxed: true runs model code unconfined where the host cannot confine it)")

    @model_validator(mode="after")
    def _python_options(self) -> ToolConfig:
        """The python tool's options are checked here, before a run starts: a misspelled or string
        `allow_unsandboxed` must not pass silently."""
        if self.name == "python":
            import dataclasses

            from rlx.agents.sandbox import SandboxLimits

            known = {field.name for field in dataclasses.fields(SandboxLimits)} | {"timeout_s"}
            unknown = sorted(set(self.options) - known)
            if unknown:
                raise ValueError(f"options {unknown} are not python tool options; use some of {sorted(known)}")
            if not isinstance(self.options.get("allow_unsandboxed", False), bool):
                raise ValueError(f"options.allow_unsandboxed must be true or false, not "
                                 f"{self.options['allow_unsandboxed']!r}")
        return self


class AgentConfig(Section):
    """Multi-turn rollouts: the policy talks to an environment (and its tools) turn by turn.
    `rollout.max_new_tokens` bounds each policy turn; `max_trajectory_tokens` the whole response."""

    environment: str = Field("tools", description="tools, feedback, or a user class package.module:Name")
    environment_options: dict[str, Any] = Field(default_factory=dict)
    isolate_environment: bool = Field(True, description="run a user environment (package.module:Name) in a "
                                      "process of its own, killed past environment_timeout_s; false: on its "
                                      "trajectory's thread in the rollout process (starts faster, cannot be killed)")
    environment_timeout_s: float = Field(60.0, gt=0.0, description="an isolated environment's reset or step "
                                         "running longer is killed with its process: the trajectory ends (env_error)")
    environment_processes: int | None = Field(None, ge=1, description="isolated environment processes per rollout "
                                              "replica (about 150 MB each), one per episode in progress; more "
                                              "trajectories wait for one to start (default: concurrency)")
    tools: list[ToolConfig] = Field(default_factory=list, description="the tools environment's tools")
    parser: str = Field("hermes", description="tool-call parser: hermes (<tool_call>{json}</tool_call>) or "
                        "module:function")
    system_prompt: str | None = Field(None, description="replaces data.system_prompt in multi-turn rollouts")
    examples: list[dict[str, Any]] = Field(default_factory=list, description="worked example messages put "
                                           "before each prompt (e.g. one tool round trip)")
    max_turns: int = Field(4, ge=1, description="policy turns per trajectory")
    max_trajectory_tokens: int = Field(1024, ge=1, description="response tokens per trajectory, observations "
                                       "included")
    tool_timeout_s: float = Field(10.0, gt=0.0, description="a tool call running longer fails (its result says so)")
    tool_latency_s: float = Field(0.0, ge=0.0, description="wall time added to each tool call without using "
                                  "the CPU, standing in for a remote sandbox or API (benchmarks)")
    max_tool_output_chars: int = Field(2000, ge=16)
    concurrency: int | None = Field(None, ge=1, description="trajectories in flight per rollout replica "
                                    "(default: rollout.max_batch_size)")


class RolloutConfig(EngineSettings):
    n: int = Field(8, ge=1, description="responses per prompt (the group size)")
    prompts_per_step: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    max_new_tokens: int = Field(64, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end a response")
    max_batch_size: int = Field(64, ge=1, description="sequences decoded together")
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    scale_timeout_s: float = Field(600.0, gt=0, description="longest wait for new rollout replicas to start; a "
                                   "scale past it is undone and reported")
    agent: AgentConfig | None = Field(None, description="multi-turn rollouts with an environment and tools "
                                      "(rlx/agents); unset: one response per prompt")
    agent_app: str | None = Field(None, description="package.module:function(base_url, api_key, row) -> reward: "
                                  "an agent program that plays each episode through an OpenAI-compatible endpoint "
                                  "(needs reward.name=environment)")
    agent_app_timeout_s: float = Field(300.0, gt=0.0, description="an episode running longer is killed and fails")
    # an agent app's episode is bounded: a call past a limit is answered 400 and its episode fails (limit)
    agent_app_max_prompt_tokens: int = Field(4096, ge=1, description="tokens of one call's rendered prompt")
    agent_app_max_calls: int = Field(32, ge=1, description="model calls per episode")
    agent_app_max_trajectory_tokens: int = Field(4096, ge=1, description="response tokens (policy and in between) "
                                                 "of one merged trajectory; a call near it gets fewer new tokens")


class JudgeConfig(EngineSettings):
    """The GenRM judge: a generation engine of its own (never the policy's: `engine`, `engine_options`
    and `dtype` here, not the rollout's) scores each response from a prompt."""

    model: str = Field("smollm2-135m-instruct", description="judge model: built-in name or HF folder")
    prompt: str = Field(
        "Question: {question}\nReference answer: {label}\nCandidate answer: {response}\n"
        "Does the candidate answer match the reference answer? Reply with yes or no.",
        description="judge prompt; fields {question}, {response}, {label}")
    parser: str = Field("yes_no", description="yes_no, score (a number divided by max_score) or module:function")
    max_score: float = Field(10.0, gt=0.0, description="the score parser divides by this")
    max_new_tokens: int = Field(8, ge=1)
    max_batch_size: int = Field(32, ge=1)
    timeout_s: float = Field(300.0, gt=0.0, description="a judge batch still generating after this fails its "
                                                        "unjudged samples (timeout); each parse has reward.timeout_s")


class RewardConfig(Section):
    name: str = Field("reasoning_gym", description="built-in reward, `genrm` (a judge model) or `module:function`")
    extract: Literal["last_number", "answer_tag", "boxed", "none"] = "last_number"
    scope: Literal["sample", "group"] = Field(
        "sample", description="a custom reward scores one response (fn(completion, label, metadata)) or a whole "
        "group (fn(completions, label, metadata) -> list of scores)")
    timeout_s: float = Field(60.0, gt=0.0, description="a reward call running longer fails its samples")
    allow_unconfined: bool = Field(False, description="where this host cannot confine reward processes (no user "
                                   "namespaces), run rewards that read model text unconfined instead of refusing "
                                   "to start")
    format_pattern: str | None = Field(None, description="reward.name=format: regex the whole completion must "
                                       "match (default <think>..</think><answer>..</answer>)")
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong punishment over the last N tokens (0: off)")
    overlong_penalty: float = Field(1.0, ge=0.0, description="penalty at the length cap")


class ClippedLoss(Section):
    """PPO/GRPO clipped surrogate; clip_high > clip_low is DAPO's clip-higher."""

    type: Literal["clipped"] = "clipped"
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="the ratio's lower bound is 1 - clip_low")
    clip_high: float = Field(0.28, ge=0.0, le=10.0, description="the ratio's upper bound is 1 + clip_high")
    dual_clip: float | None = Field(None, gt=1.0, description="dual-clip bound c for negative advantages (e.g. 3)")


class GspoLoss(Section):
    """GSPO: one length-normalised ratio per sequence, clipped much tighter than a token's."""

    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0.0, le=1.0)
    clip_high: float = Field(4e-4, ge=0.0, le=1.0)


class SapoLoss(Section):
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip."""

    type: Literal["sapo"] = "sapo"
    tau_pos: float = Field(1.0, gt=0.0, description="gate temperature for positive advantages")
    tau_neg: float = Field(1.05, gt=0.0, description="gate temperature for negative advantages")


class CispoLoss(Section):
    """CISPO: a clipped, detached importance weight on every token's log-prob."""

    type: Literal["cispo"] = "cispo"
    clip_low: float = Field(1.0, ge=0.0, le=1.0, description="the weight's floor is 1 - clip_low (1: none)")
    clip_high: float = Field(0.28, ge=0.0)


class CustomLoss(Section):
    """A policy loss of your own, registered in `rlx.algorithms.POLICY_LOSSES`.

    Register `fn(inputs: LossInputs, config: CustomLoss) -> LossTerms` with
    `@POLICY_LOSSES.register("my_loss")` in a module of yours, and select it with
    `algorithm.loss: {type: custom, name: "my_pkg.losses:my_loss", options: {...}}`. The part
    before the colon is imported first, in every process that builds the loss (Ray workers too),
    so its registration runs there; a bare `name` needs the registration to have run already (a
    program that registers, then starts a colocated run). A free-form `options` dict rather than a
    config class per plug-in keeps the union closed, so errors stay precise for built-in losses.
    """

    type: Literal["custom"] = "custom"
    name: str = Field(description="`module:registered_name`, or a name already in POLICY_LOSSES")
    options: dict[str, Any] = Field(default_factory=dict, description="free settings, read by the loss as "
                                    "config.options")

    @field_validator("name")
    @classmethod
    def _is_registered(cls, name: str) -> str:
        from rlx.algorithms.losses import find_policy_loss

        find_policy_loss(name)
        return name


LossConfig = Annotated[ClippedLoss | GspoLoss | SapoLoss | CispoLoss | CustomLoss, Field(discriminator="type")]
LOSS_CONFIGS: dict[str, type[Section]] = {"clipped": ClippedLoss, "gspo": GspoLoss, "sapo": SapoLoss,
                                          "cispo": CispoLoss, "custom": CustomLoss}
Correction = Literal["none", "tis", "decoupled"]


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "none"] = Field(
        "grpo", description="gae: PPO with a critic (section `critic`); none: no task advantage (distillation only)")
    loss: LossConfig = Field(default_factory=ClippedLoss, description="the policy loss and its knobs, chosen by "
                             "`type`: clipped (when type is left out), gspo, sapo, cispo, or custom")
    norm_std: bool = Field(True, description="divide GRPO advantages by the group std (false: Dr.GRPO)")
    std_eps: float = Field(1e-6, gt=0.0, description="added to the std (outside the square root) where GRPO and "
                           "REINFORCE++ (over responses) divide by it; TRL uses 1e-4, verl 1e-6")
    reinforce_pp_normalize: Literal["responses", "tokens"] = Field(
        "responses", description="REINFORCE++ (and _baseline): normalise over responses (each counts once), or over "
        "tokens as verl (a response weighs by its trained tokens; Bessel over tokens, rsqrt(var + 1e-8))")
    kl_coef: float = Field(0.0, ge=0.0)
    kl_reference_refresh_every: int = Field(
        0, ge=0, description="0: the KL reference is the initial policy; N: it takes the policy's weights every N "
        "steps (a periodically reset reference, as in ProRL)")
    kl_type: Literal["k1", "k2", "k3", "low_var", "k3_ratio"] = Field(
        "k3", description="the per-token KL term (docs/algorithms.md says which gradient each gives): k3 and "
        "low_var (k3 clamped to [0, 10]) pull along the forward KL(ref||pi), k2 and k3_ratio (k3 times the "
        "differentiable ratio pi/pi_old, TRL's default) along the reverse KL(pi||ref), k1 adds no gradient in "
        "expectation")
    entropy_coef: float = Field(0.0, ge=0.0)
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    loss_horizon: int = Field(1024, ge=1, description="constant divisor of seq-mean-token-sum (Dr.GRPO)")
    filter_zero_std_groups: bool = Field(True, description="skip groups whose rewards are all equal")
    dynamic_sampling: bool = Field(False, description="DAPO: refill the step with new groups for those filtered")
    max_groups_per_step: float = Field(3.0, ge=1.0, description="dynamic sampling stops a step after this many "
                                       "times prompts_per_step groups, trainable or not")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="GAE discount")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda")
    whiten_advantages: bool = Field(True, description="GAE: normalise token advantages over the trained tokens "
                                    "of each batch (observation tokens of agent samples excluded)")
    whiten_variance: Literal["unbiased", "population"] = Field(
        "unbiased", description="GAE whitening's variance: unbiased (Bessel's N-1 over the trained tokens, as verl) "
        "or population (divided by N, rlx before 2026-12)")
    behavior_correction: Literal["auto", "none", "tis", "decoupled"] = Field(
        "auto", description="off-policy correction against the rollout log-probs: tis (truncated importance "
        "sampling), decoupled (PPO ratio against ActorFwd's proximal policy, weight proximal/behaviour), none, or "
        "auto: decoupled in async mode with train.max_staleness > 0, else tis when rollout.engine is not hf or "
        "rollout.dtype differs from train.param_dtype, else none. Resolved once, when the RunConfig is "
        "validated; `rlx doctor` prints the result")
    tis_cap: float = Field(2.0, ge=1.0, description="truncation of the importance weight")
    routing_replay: Literal["auto", "off", "r3"] = Field(
        "auto", description="mixture-of-experts models: r3 (Rollout Routing Replay) routes every token, in every "
        "trainer forward (Actor, ActorFwd, Reference), to the experts the rollout engine chose; off: the trainer "
        "routes itself. auto: r3 for a MoE model whose engine reports routes (hf, vllm in-process, sglang), else off. r3 on a "
        "dense model is an error")
    routing_mismatch_every: int = Field(
        10, ge=0, description="R3: every N steps one extra forward without replay measures the rollout/trainer "
        "log-prob mismatch that replay removes (r3/logprob_abs_diff_without_replay); 0: never")
    router_aux_loss_coef: float = Field(
        0.0, ge=0.0, description="mixture-of-experts models: weight of the load-balancing loss (Switch: "
        "E * sum_e f_e P_e per MoE layer, averaged over layers), computed from the experts the forward used (the replayed "
        "ones under R3); 0: off (a dense model needs 0)")
    _resolved_correction: Correction | None = PrivateAttr(None)

    @field_validator("loss", mode="before")
    @classmethod
    def _clipped_by_default(cls, value: Any) -> Any:
        """`algorithm.loss.clip_high=0.2` alone tunes the default loss; a type not built in gets its fix."""
        if not isinstance(value, dict):
            return value
        kind = value.get("type", "clipped")
        if kind not in LOSS_CONFIGS:
            raise ValueError(f"algorithm.loss.type={kind!r} is not one of {', '.join(LOSS_CONFIGS)}; a loss "
                             "registered in POLICY_LOSSES is chosen with algorithm.loss.type=custom "
                             "algorithm.loss.name=module:name")
        return {**value, "type": kind}

    @property
    def resolved_correction(self) -> Correction:
        """The correction in effect: `auto` as the RunConfig holding this section resolved it. A lone
        AlgorithmConfig (unit tests, benches) resolves `auto` as a default run does: none."""
        if self.behavior_correction != "auto":
            return self.behavior_correction
        return self._resolved_correction or "none"


class CriticConfig(Section):
    """The value model of PPO (`algorithm.advantage=gae`): its own engine and optimizer."""

    path: str | None = Field(None, description="initial weights: a built-in name or HF folder (default: model.path)")
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    value_clip: float = Field(0.2, gt=0.0, description="clip of the value update around the old values")
    grad_clip: float = Field(1.0, gt=0.0)


class TeacherConfig(Section):
    """On-policy distillation: a Teacher role scores the student's sampled tokens."""

    path: str | None = Field(None, description="teacher model: built-in name or HF folder; unset = no teacher")
    coef: float = Field(1.0, gt=0.0, description="weight of the reverse-KL advantage")


class TrainConfig(Section):
    mode: Literal["colocate", "async"] = "colocate"
    max_staleness: int = Field(0, ge=0, description="0 = strictly on-policy (async mode)")
    steps: int = Field(40, ge=1)
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.99), description="Adam's (beta1, beta2), each in [0, 1)")
    grad_clip: float = Field(1.0, gt=0.0)
    micro_batch_size: int = Field(16, ge=1)
    trainable: list[str] = Field(
        default_factory=list, description="parameter-name patterns (fnmatch) the trainer updates, the rest frozen; "
        "empty: all. e.g. ['model.vision_tower.*', 'model.multi_modal_projector.*'] trains a LLaVA model's vision "
        "side on a frozen language model")
    activation_checkpointing: bool = Field(
        False, description="recompute each layer's activations during backward instead of keeping them: less "
        "memory for about one more forward of compute (R3 routes stay in force for the recomputation)")
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's samples; more than 1 (or mini_batches "
                            "> 1) takes several optimizer updates per step, against old log-probs taken before "
                            "the first, so the clip acts")
    mini_batches: int = Field(1, ge=1, description="optimizer updates per epoch; a sample's mini-batch is a "
                              "seeded function of its uid, never of arrival or length order")
    share_prompts: bool = Field(
        True, description="rows of a micro-batch that share a prompt (a GRPO group) run it once and reuse its KV "
        "cache for their responses, in every trainer-side forward (Actor, ActorFwd, Reference, Teacher): the same "
        "log-probs and gradients up to float rounding, fewer FLOPs. Not applied to media, replayed MoE routes, "
        "activation checkpointing or rank groups (resources.*.ranks > 1)")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="training compute precision. bfloat16: the Actor's and the Critic's forward and "
        "backward run under bf16 autocast, while their weights, gradients and AdamW state stay float32 (rlx keeps "
        "no bf16 parameters). Reference and Teacher load their weights in this dtype; ActorFwd keeps float32 "
        "weights under the same autocast as the Actor, so its proximal log-probs match the Actor's own")
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the gradient reduction across the ranks of a sharded trainer "
        "(resources.actor.ranks > 1). A one-process trainer reduces nothing and accumulates in float32. bfloat16 "
        "is accepted only with param_dtype=bfloat16")
    eval_every: int = Field(10, ge=0, description="0 evaluates only before and after training")
    checkpoint_every: int = Field(0, ge=0, description="0 saves only the final checkpoint")
    time_budget_s: float | None = Field(None, gt=0, description="stop after this much wall time")
    step_timeout_s: float = Field(600.0, gt=0, description="longest wait for one step's samples before failing")
    hang_timeout_s: float = Field(300.0, gt=0, description="a role making no progress this long is hung and "
                                  "gets replaced (async mode)")
    heartbeat_timeout_s: float = Field(15.0, gt=0, description="a replica silent this long is dead: its work "
                                       "is recovered (async mode; replicas beat every second)")
    max_restarts_per_role: int = Field(3, ge=0, description="replacements of one role (a replica lost, hung or "
                                       "whose worker raised; the Actor and Critic from their newest checkpoint) "
                                       "before the run stops")
    max_restarts: int = Field(10, ge=0, description="replacements of all roles together before the run stops")
    seed: int = 0
    check_bus_schema: bool = Field(
        False, description="debug: the bus checks every put against its field's declaration (dtype, shape, scope "
        "in rlx/orchestration/plan.py FIELDS) and a put that does not match fails, naming the field, its writer, "
        "what was expected and what came; costs a pass over every value. The test suite's runs turn it on")

    @property
    def bf16_autocast(self) -> bool:
        """Whether training forwards run under bf16 autocast (param_dtype=bfloat16, float32 master weights)."""
        return self.param_dtype == "bfloat16"


class RoleResources(Section):
    num_cpus: float = Field(0.5, ge=0.0, description="Ray logical CPUs reserved for the role's replica")
    num_gpus: float = Field(0.0, ge=0.0)
    threads: int = Field(1, ge=1, description="torch intra-op threads inside the replica")
    replicas: int = Field(1, ge=1, le=16, description="replicas of the role (async mode). A stateless role with 2 "
                          "or more keeps serving while a lost one is replaced; the Rollout starts with this "
                          "many (`rlx scale` changes it); the Actor and the Critic have exactly one")
    ranks: int = Field(1, ge=1, le=64, description="processes that hold the role's model together, its parameters "
                       "(and a trainer's gradients and optimizer state) sharded over them (FSDP2; gloo on CPU, nccl "
                       "with GPUs). Actor, Critic, Reference, Teacher and ActorFwd; each rank reserves num_cpus and num_gpus")


class ResourcesConfig(Section):
    device: Literal["cpu", "cuda"] = "cpu"
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; default: all cores")
    ray_address: str | None = Field(None, description="join this Ray cluster instead of starting a local one")
    ray_allow_unauthenticated: bool = Field(False, description="join a ray_address cluster that accepts clients "
                                            "without Ray's auth token, or run on a Ray before 2.60 (whose Serve "
                                            "replicas take unauthenticated calls): anyone who reaches it can run code "
                                            "in the run")
    ray_num_cpus: float = Field(8.0, gt=0, description="logical CPUs of a local Ray cluster")
    rollout: RoleResources = Field(default_factory=RoleResources)
    actor: RoleResources = Field(default_factory=RoleResources)
    reward: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=0.1))
    advantages: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=0.1))
    reference: RoleResources = Field(default_factory=RoleResources)
    actor_fwd: RoleResources = Field(default_factory=RoleResources)
    critic: RoleResources = Field(default_factory=RoleResources)
    teacher: RoleResources = Field(default_factory=RoleResources)
    genrm: RoleResources = Field(default_factory=RoleResources)


class FaultConfig(Section):
    """Fault injection for tests and drills: kill, hang or make raise one role's replica, or kill a
    shared actor of the run, after a given step."""

    role: str = Field(description="a role of this run: rollout, reward, advantages, reference, ...; "
                      "dcs, the weight coordinator; or bus, prompts, heartbeats (the run's shared actors)")
    at_step: int = Field(ge=1, description="the actor fires it right after its own step `at_step`; other "
                         "roles get it once the driver has seen that step")
    kind: Literal["kill", "hang", "raise"] = Field(
        "kill", description="kill: the process exits; hang: its worker loop blocks forever without a heartbeat; "
        "raise: its worker loop raises an out-of-memory RuntimeError (roles only)")


def _needs_package(enabled: bool, module: str, field: str) -> bool:
    """A metrics sink turned on without its package fails when the config is read, not mid-run."""
    if enabled and importlib.util.find_spec(module) is None:
        raise ValueError(f"{field}=true needs the {module} package: pip install 'rlx[logging]' "
                         f"(or pip install {module})")
    return enabled


class WandbConfig(Section):
    """Weights & Biases: each metrics.jsonl line becomes one W&B history row (same keys, x-axis `step`)
    and the resolved config the run's config. Offline by default: files under <run_dir>/wandb, sent
    later with `wandb sync`; online needs `wandb login` or WANDB_API_KEY."""

    enabled: bool = False
    project: str = "rlx"
    name: str | None = Field(None, description="W&B run name; default logging.name")
    mode: Literal["offline", "online"] = "offline"

    @field_validator("enabled")
    @classmethod
    def _installed(cls, enabled: bool) -> bool:
        return _needs_package(enabled, "wandb", "logging.wandb.enabled")


class LoggingConfig(Section):
    name: str = "run"
    run_dir: str | None = Field(None, description="default runs/<name>")
    progress_bar: bool = True
    tensorboard: bool = Field(False, description="the metrics.jsonl keys as scalars under <run_dir>/tensorboard")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    alerts: list[str] = Field(default_factory=list, description="Apprise URLs notified on failure, recovery "
                              "and finish (e.g. json://127.0.0.1:8000/hook, mailto://, slack://)")

    @field_validator("tensorboard")
    @classmethod
    def _installed(cls, enabled: bool) -> bool:
        return _needs_package(enabled, "tensorboard", "logging.tensorboard")


class WeightsConfig(Section):
    """Weight sync (DCS) from the Actor to the generation engines and ActorFwd (async mode)."""

    channel: Literal["object-store", "gloo", "nccl"] = Field(
        "object-store", description="object-store (Ray, any node), gloo (CPU broadcast) or nccl (GPU broadcast)")
    bucket_mb: float = Field(256, gt=0, description="weights travel in buckets of at most this size")
    timeout_s: float = Field(120, gt=0, description="longest wait for a weight version or a broadcast peer")


class RunConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    faults: list[FaultConfig] = Field(default_factory=list, description="async mode: faults to inject")

    @model_validator(mode="after")
    def _choices_fit_together(self) -> RunConfig:
        problems = choice_conflicts(self)
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    @model_validator(mode="after")
    def _resolve_behavior_correction(self) -> RunConfig:
        """`algorithm.behavior_correction=auto` depends on other sections: resolved here, once."""
        self.algorithm._resolved_correction = auto_correction(self)[0]
        return self

    @property
    def initial_rollout_replicas(self) -> int:
        """`resources.rollout.replicas`, brought into the autoscaler's range when it is on."""
        replicas, scale = self.resources.rollout.replicas, self.rollout.autoscale
        return min(max(replicas, scale.min_replicas), scale.max_replicas) if scale.enabled else replicas

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.advantage == "gae"

    @property
    def routing_replay(self) -> Literal["off", "r3"]:
        """`algorithm.routing_replay` in effect (`auto` resolved against the model and the engine)."""
        return resolve_routing_replay(self)[0]

    @property
    def uses_teacher(self) -> bool:
        return self.teacher.path is not None

    @property
    def filters_zero_std_groups(self) -> bool:
        """Equal rewards teach nothing only when the advantage is relative to the group's rewards."""
        a = self.algorithm
        return a.filter_zero_std_groups and a.advantage in GROUP_RELATIVE and not self.uses_teacher

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir or Path("runs") / self.logging.name)

    def resolved(self) -> dict[str, str]:
        """What the `auto` settings resolved to (it depends on other sections)."""
        return {"algorithm.behavior_correction": self.algorithm.resolved_correction,
                "algorithm.routing_replay": self.routing_replay}

    def to_yaml(self, redact: bool = False) -> str:
        """The config as given, plus a comment with what `auto` resolved to. `redact`: without the
        secrets a config may hold inline (alert URLs, engines' `api_key`), each named in a comment,
        for the copy kept in the run directory."""
        data = self.model_dump(mode="json")
        comments = [f"# {key} resolved to {value}" for key, value in self.resolved().items()]
        if redact:
            comments += [f"# {where} left out (a secret): give it again to reuse this file" for where in redact_secrets(data)]
        return "".join(line + "\n" for line in comments) + yaml.safe_dump(data, sort_keys=False)


def redact_secrets(data: dict[str, Any]) -> list[str]:
    """Remove the secrets from a dumped config in place: `logging.alerts` (Apprise URLs carry tokens) and
    `api_key` in any `engine_options`. Returns where each was."""
    removed = []
    if data["logging"]["alerts"]:
        data["logging"]["alerts"], removed = [], ["logging.alerts"]
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            if where.endswith("engine_options") and node.pop("api_key", None) is not None:
                removed.append(f"{where}.api_key")
            stack += [(f"{where}.{key}".lstrip("."), value) for key, value in node.items()]
    return sorted(removed)


GROUP_RELATIVE = ("grpo", "rloo", "reinforce_pp_baseline")
SHARDABLE_ROLES = ("actor", "critic", "reference", "teacher", "actor_fwd")


def choice_conflicts(c: RunConfig) -> list[str]:
    """Algorithm, role and reward choices that cannot work together, each with its fix."""
    a, problems = c.algorithm, []
    if c.data.has_media and c.rollout.engine != "hf":
        problems.append(f"media rows (data.media_keys / data.source={c.data.source}) go through rlx's own processor "
                        f"into the hf engine only; rollout.engine={c.rollout.engine} takes text: set rollout.engine=hf")
    if c.data.has_media and c.rollout.agent_app is not None:
        problems.append("an agent app's calls carry text only: unset rollout.agent_app (rollout.agent takes a row's "
                        "media into its trajectories), or drop data.media_keys")
    if a.advantage == "none" and not c.uses_teacher:
        problems.append("algorithm.advantage=none trains on nothing without a teacher: set teacher.path=<model> "
                        "for on-policy distillation, or pick an advantage such as grpo")
    if a.advantage in GROUP_RELATIVE and c.rollout.n < 2:
        problems.append(f"algorithm.advantage={a.advantage} compares responses within a group: set rollout.n>=2, "
                        "or use advantage=gae (PPO with a critic) or reinforce_pp")
    if a.dynamic_sampling and not c.filters_zero_std_groups:
        problems.append("algorithm.dynamic_sampling refills groups dropped for equal rewards: it needs "
                        "algorithm.filter_zero_std_groups=true, a group-relative advantage (grpo, rloo, "
                        "reinforce_pp_baseline) and no teacher")
    if a.kl_reference_refresh_every and a.kl_coef <= 0:
        problems.append("algorithm.kl_reference_refresh_every refreshes the KL reference, but algorithm.kl_coef=0 "
                        "uses none: set kl_coef>0 (e.g. 0.05), or remove kl_reference_refresh_every")
    if c.critic.path is not None and not c.uses_critic:
        problems.append(f"critic.path is set but algorithm.advantage={a.advantage} uses no critic: "
                        "set algorithm.advantage=gae for PPO, or remove critic.path")
    if a.loss.type == "gspo" and (a.advantage == "gae" or c.uses_teacher):
        problems.append("algorithm.loss.type=gspo needs one advantage per sequence; gae and distillation give "
                        "one per token: use algorithm.loss.type=clipped")
    if a.loss.type == "gspo" and a.aggregation != "seq-mean-token-mean":
        problems.append(f"algorithm.loss.type=gspo averages its sequence losses over sequences; with "
                        f"aggregation={a.aggregation} its gradient is GRPO's: set algorithm.aggregation=seq-mean-token-mean")
    if a.routing_replay == "r3" and is_moe_model(c.model.path) is False:
        problems.append(f"algorithm.routing_replay=r3 replays mixture-of-experts routes, but model.path="
                        f"{c.model.path!r} is a dense model: set algorithm.routing_replay=off (or auto)")
    if a.router_aux_loss_coef > 0 and is_moe_model(c.model.path) is False:
        problems.append(f"algorithm.router_aux_loss_coef balances mixture-of-experts routers, but model.path="
                        f"{c.model.path!r} is a dense model: set algorithm.router_aux_loss_coef=0")
    if a.routing_replay == "r3" and not reports_routes(c.rollout):
        problems.append(f"algorithm.routing_replay=r3 needs the experts the engine routed to; {engine_named(c.rollout)} "
                        f"does not report them: use rollout.engine={' or '.join(sorted(ROUTE_REPORTING_ENGINES))} "
                        "(vllm in-process), or set algorithm.routing_replay=off")
    if c.rollout.agent is not None and c.rollout.agent_app is not None:
        problems.append("rollout.agent (an environment rlx drives) and rollout.agent_app (a program that drives "
                        "the policy) are two ways to roll out: set one of them")
    if c.rollout.agent_app is not None and c.reward.name != "environment":
        problems.append(f"rollout.agent_app returns each episode's reward; reward.name={c.reward.name!r} would score "
                        "something else: set reward.name=environment")
    if c.rollout.autoscale.enabled and c.train.mode != "async":
        problems.append("rollout.autoscale scales rollout replicas, which exist in async mode only: "
                        "set train.mode=async, or rollout.autoscale.enabled=false")
    replicas = {role: value.replicas for role, value in c.resources if isinstance(value, RoleResources)}
    for role in ("actor", "critic"):
        if replicas[role] != 1:
            problems.append(f"resources.{role}.replicas={replicas[role]}: the {role} holds its optimizer state in "
                            "one replica; set it to 1")
    replicated = [role for role, count in replicas.items() if count > 1]
    if replicated and c.train.mode != "async":
        problems.append(f"resources.{replicated[0]}.replicas > 1 needs separate services, which exist in async mode "
                        "only: set train.mode=async, or replicas=1")
    scale, explicit = c.rollout.autoscale, "replicas" in c.resources.rollout.model_fields_set
    if scale.enabled and explicit and not scale.min_replicas <= c.resources.rollout.replicas <= scale.max_replicas:
        problems.append(f"resources.rollout.replicas={c.resources.rollout.replicas} is outside rollout.autoscale's "
                        f"range {scale.min_replicas}..{scale.max_replicas}: start within it")
    ranked = [role for role, value in c.resources if isinstance(value, RoleResources) and value.ranks > 1]
    for role in ranked:
        if role not in SHARDABLE_ROLES:
            problems.append(f"resources.{role}.ranks={getattr(c.resources, role).ranks}: only the "
                            f"{', '.join(SHARDABLE_ROLES)} shard over ranks; set it to 1")
    trainers = [role for role in ranked if role in ("actor", "critic")]
    if trainers and (c.train.ppo_epochs > 1 or c.train.mini_batches > 1):
        problems.append(f"resources.{trainers[0]}.ranks > 1 with train.ppo_epochs={c.train.ppo_epochs} and "
                        f"train.mini_batches={c.train.mini_batches}: a sharded trainer takes one update per step "
                        "for now; set both to 1, or ranks=1")
    if c.reward.scope == "group" and ":" not in c.reward.name:
        problems.append(f"reward.scope=group needs a custom group reward (module:function); {c.reward.name!r} "
                        "scores one response at a time: set reward.scope=sample")
    if c.train.reduce_dtype == "bfloat16" and c.train.param_dtype == "float32":
        problems.append("train.reduce_dtype=bfloat16 with train.param_dtype=float32 would reduce gradients below "
                        "the precision they were computed in: set train.reduce_dtype=float32")
    return problems


def auto_correction(c: RunConfig) -> tuple[Correction, str]:
    """What `algorithm.behavior_correction` is in effect, and why (for `rlx doctor`).

    `auto`: decoupled when the trainer may get samples from older weights (async mode with
    max_staleness > 0; colocated runs always train on the current weights); else tis when the
    behaviour log-probs come from other numerics than the trainer's (another engine's kernels, or
    another dtype); else none.
    """
    t, r = c.train, c.rollout
    if c.algorithm.behavior_correction != "auto":
        return c.algorithm.behavior_correction, "set explicitly"
    if t.mode == "async" and t.max_staleness > 0:
        return "decoupled", f"train.max_staleness={t.max_staleness}: samples may come from older weights"
    if r.engine != "hf":
        return "tis", f"rollout.engine={r.engine} computes the behaviour log-probs with other kernels than the trainer"
    if r.dtype != t.param_dtype:
        return "tis", f"rollout.dtype={r.dtype} differs from the trainer's train.param_dtype={t.param_dtype}"
    return "none", "on-policy samples from the trainer's own engine and dtype"


def reports_routes(rollout: RolloutConfig) -> bool:
    """Whether the rollout's engine returns the experts it routed to (vLLM does in-process, not by URL)."""
    return rollout.engine in ROUTE_REPORTING_ENGINES and not (rollout.engine == "vllm" and "url" in rollout.engine_options)


def engine_named(rollout: RolloutConfig) -> str:
    by_url = " by URL (engine_options.url)" if "url" in rollout.engine_options else ""
    return f"rollout.engine={rollout.engine}{by_url}"


def resolve_routing_replay(c: RunConfig) -> tuple[Literal["off", "r3"], str]:
    """Whether the trainer replays the rollout's expert routes (R3), and why (for `rlx doctor`)."""
    setting, moe = c.algorithm.routing_replay, is_moe_model(c.model.path)
    if setting != "auto":
        return setting, "set explicitly"
    if not moe:
        return "off", f"model.path={c.model.path!r} is not a mixture-of-experts model"
    if not reports_routes(c.rollout):
        return "off", f"{engine_named(c.rollout)} does not report the experts it routed to"
    return "r3", (f"model.path={c.model.path!r} is a mixture-of-experts model and "
                  f"rollout.engine={c.rollout.engine} reports its routes")


def lost_actor_cost(c: RunConfig) -> str:
    """What losing the Actor costs (async mode's global recovery, or a crash then `--resume`): the
    steps since its newest checkpoint. `rlx doctor` and an async run's start say it."""
    every, rows = c.train.checkpoint_every, c.rollout.prompts_per_step * c.rollout.n
    if every == 0:
        return ("train.checkpoint_every=0: no checkpoint before the last step, so a lost Actor restarts from the "
                "initial weights and rolls back every step done so far (their samples are counted in "
                "samples_rolled_back, never trained again), and a crashed run resumes from step 0; set "
                "train.checkpoint_every to bound the loss")
    steps = f"{every - 1} step{'' if every == 2 else 's'}"
    return (f"train.checkpoint_every={every}: a lost Actor or a crashed run redoes at most {steps} "
            f"(up to {(every - 1) * rows} samples rolled back)")


def config_warnings(c: RunConfig) -> list[str]:
    """Allowed choices that are probably not what the user wants; `rlx doctor` prints them."""
    warnings = []
    if c.algorithm.behavior_correction == "none" and c.train.mode == "async" and c.train.max_staleness > 0:
        warnings.append(f"algorithm.behavior_correction=none with train.max_staleness={c.train.max_staleness}: "
                        "samples from older weights train uncorrected, as if on-policy; set "
                        "algorithm.behavior_correction=auto (decoupled here) or tis")
    if c.train.reduce_dtype == "bfloat16" and c.resources.actor.ranks == 1:
        warnings.append("train.reduce_dtype=bfloat16 has no effect: the trainer is one process (resources.actor."
                        "ranks=1) and accumulates gradients in float32")
    judge = c.reward.judge
    if c.reward.name == "genrm" and c.rollout.engine != "hf" and "engine" not in judge.model_fields_set:
        warnings.append(f"the GenRM judge runs on its own engine, reward.judge.engine=hf, not the policy's "
                        f"rollout.engine={c.rollout.engine}: set reward.judge.engine (and engine_options) to change it")
    if c.algorithm.reinforce_pp_normalize == "tokens" and not c.algorithm.advantage.startswith("reinforce_pp"):
        warnings.append(f"algorithm.reinforce_pp_normalize=tokens has no effect with algorithm.advantage="
                        f"{c.algorithm.advantage}: it applies to reinforce_pp and reinforce_pp_baseline")
    if c.algorithm.kl_type == "k1" and c.algorithm.kl_coef > 0:
        warnings.append(f"algorithm.kl_type=k1 with kl_coef={c.algorithm.kl_coef}: k1's gradient is zero in "
                        "expectation, so the KL term adds only noise; use kl_type=k3 (forward KL), k2 or k3_ratio "
                        "(reverse KL)")
    res = c.resources
    if (c.train.mode == "async" and c.algorithm.resolved_correction == "decoupled" and res.actor.num_gpus > 0
            and res.actor_fwd.num_gpus == 0):
        warnings.append("decoupled PPO runs an ActorFwd service with a copy of the policy, and "
                        "resources.actor_fwd.num_gpus=0 while the Actor has GPUs: give it resources.actor_fwd.num_gpus")
    if c.train.mode == "async" and c.train.checkpoint_every == 0:
        warnings.append(lost_actor_cost(c))
    return warnings


MOVED_KEYS = {
    "algorithm.policy_loss": "algorithm.loss.type",
    **{f"algorithm.{key}": f"algorithm.loss.{key} (with algorithm.loss.type=clipped, the default)"
       for key in ("clip_low", "clip_high", "dual_clip")},
    **{f"algorithm.{loss}_{key}": f"algorithm.loss.{key} (with algorithm.loss.type={loss})"
       for loss, keys in (("gspo", ("clip_low", "clip_high")), ("sapo", ("tau_pos", "tau_neg")),
                          ("cispo", ("clip_low", "clip_high"))) for key in keys},
    "model.dtype": "rollout.dtype (generation) and train.param_dtype (training, Reference, Teacher, ActorFwd)",
    "train.autocast_bf16": "train.param_dtype (bfloat16: bf16 autocast over float32 weights)",
}


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `a.b.c=value` pairs into a nested dict; values are parsed as YAML scalars/lists."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. train.lr=1e-6)")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[leaf] = parse_yaml(text) if text else ""
    return raw


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: Any = RunConfig
    for part in map(str, loc[:-1]):
        if isinstance(model, dict):  # inside the loss union, pydantic names the member by its tag
            model = model[part]
            continue
        annotation = model.model_fields[part].annotation
        if model is AlgorithmConfig and part == "loss":
            model = LOSS_CONFIGS
            continue
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _user_loc(loc: tuple[Any, ...]) -> tuple[str, ...]:
    """The key path as users write it: without the tag pydantic adds (algorithm.loss.gspo.clip_low)."""
    return tuple(str(p) for i, p in enumerate(loc) if not (i and loc[i - 1] == "loss" and p in LOSS_CONFIGS))


def _describe(error: dict[str, Any]) -> str:
    loc = tuple(error["loc"])
    if not loc:  # a cross-field check: its message names the keys itself
        return error["msg"].removeprefix("Value error, ")
    path = _user_loc(loc)
    key = ".".join(path)
    if error["type"] == "extra_forbidden" and key in MOVED_KEYS:
        return f"{key} moved to {MOVED_KEYS[key]}"
    if error["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc)
        close = difflib.get_close_matches(path[-1], allowed, n=1)
        hint = f" Did you mean {'.'.join(path[:-1] + (close[0],))!r}?" if close else ""
        owners = [kind for kind, section in LOSS_CONFIGS.items() if path[-1] in section.model_fields]
        if path[:2] == ("algorithm", "loss") and owners:
            hint += f" {path[-1]} is a key of algorithm.loss.type={' or '.join(owners)}."
        return f"unknown key {key!r}.{hint} Allowed here: {', '.join(allowed)}"
    return f"{key} = {error.get('input')!r}: {error['msg']}"


def build_config(raw: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [_describe(e) for e in exc.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def read_yaml_mapping(path: str | Path | None, what: str = "config file") -> dict[str, Any]:
    """The mapping a YAML file holds (empty for no file); any other content is a ConfigError naming `what`."""
    if path is None:
        return {}
    try:
        raw = parse_yaml(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {str(path)!r} must hold a mapping of keys, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    return build_config(apply_overrides(read_yaml_mapping(path), list(overrides)))
