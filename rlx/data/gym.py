"""Built-in task sources from reasoning-gym, with a held-out eval split no train row repeats."""

from __future__ import annotations

from typing import Any

from rlx.data.rows import DataError, PromptRow

SUPPORTED_TASKS = ("chain_sum", "basic_arithmetic", "countdown", "gsm_symbolic")
EVAL_SEED_OFFSET = 1_000_003
# reasoning-gym seeds item i of a dataset with `seed + i`: datasets of seeds 0 and 1 would share all
# but one item. data.seed s draws from reasoning-gym seed s * GYM_SEED_STRIDE instead (seed 0 as
# before), so every seed's train and held-out items are disjoint from every other seed's.
GYM_SEED_STRIDE = 10_000_019


def _rows(task: str, params: dict[str, Any], size: int, seed: int) -> list[PromptRow]:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **params)
    except (ValueError, TypeError, AssertionError) as exc:
        raise DataError(f"data.task={task!r} with data.task_params={params}: {exc}") from None
    return [
        PromptRow(
            prompt=entry["question"],
            label=str(entry["answer"]),
            metadata={**entry["metadata"], "source_dataset": task, "question": entry["question"]},
            source=f"reasoning-gym {task} seed {seed} item {index}",
        )
        for index, entry in enumerate(dataset)
    ]


def gym_splits(task: str, params: dict[str, Any], train_size: int, eval_size: int, seed: int):
    """(train, eval) rows; eval comes from another seed and drops questions seen in train."""
    if task not in SUPPORTED_TASKS:
        raise DataError(f"data.task={task!r} is not a built-in task; use one of {', '.join(SUPPORTED_TASKS)}")
    seed *= GYM_SEED_STRIDE
    train = _rows(task, params, train_size, seed)
    if eval_size == 0:
        return train, []
    seen = {row.prompt for row in train}
    held_out: list[PromptRow] = []
    for attempt in range(1, 5):  # small task spaces overlap a lot: draw ever more candidates
        candidates = _rows(task, params, eval_size * 4**attempt, seed + EVAL_SEED_OFFSET)
        held_out = list({row.prompt: row for row in candidates if row.prompt not in seen}.values())[:eval_size]
        if len(held_out) == eval_size:
            break
    if len(held_out) < eval_size:
        raise DataError(f"only {len(held_out)} held-out {task} problems differ from the train split; "
                        f"lower data.eval_size or widen data.task_params")
    return train, held_out
