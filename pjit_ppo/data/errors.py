"""The error a user's data causes (a missing file, a bad record, a tokenizer that does not
fit the model): one message naming the file, the line or field, and the fix."""


class DataError(ValueError):
    """Bad or missing data; the message names the file (and line or field) and the fix."""
