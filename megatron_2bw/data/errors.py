"""The one exception for bad data inputs."""


class DataError(ValueError):
    """A data input (dataset prefix, index file, tokenizer model, JSONL line) is unusable.

    The message starts with the command-line flag that named the input, e.g.
    `--data-path: /x/y.idx is not a Megatron indexed dataset index (bad magic header)`, so the
    user knows which argument to fix. Raised before training starts.
    """

    def __init__(self, flag: str, detail: str) -> None:
        super().__init__(f"{flag}: {detail}")
        self.flag = flag
        self.detail = detail

    def __reduce__(self):
        # Rebuild from both fields, so the error survives a multiprocessing worker boundary.
        return type(self), (self.flag, self.detail)
