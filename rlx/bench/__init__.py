"""Benchmarks (`rlx bench ...`): side-by-side measurements that print ratios; not tests."""
