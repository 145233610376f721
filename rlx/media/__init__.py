"""Media inputs (images, audio, video): decoding untrusted media within limits, and turning it into
the model inputs each architecture takes, with its placeholder tokens expanded to match."""
