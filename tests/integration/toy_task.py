"""A toy task a random tiny model can learn in seconds: answer with as many 'a's as possible."""


def count_a(completion: str, label: str, metadata: dict) -> float:
    """Share of characters in the completion equal to the label character."""
    return completion.count(label) / max(1, len(completion))
