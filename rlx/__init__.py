"""rlx: asynchronous RL post-training for language models (map: docs/architecture.md).

A regular package, not a namespace one: a namespace `rlx` merges every `rlx/` folder on the path
(an editable install's beside a checkout's), so a checkout could import, and grimp would scan, a
module it does not hold.
"""
