"""Plain values, and the JSON-lines channel that carries them, across the code sandbox's call-process/judge boundary (see tasks/sandbox/harness.py).
Standard library only: copied into the sandbox beside the harness and imported there as
`sandbox_codec`; the pipeline's tests import it as `tasks.sandbox.codec`."""

import json
import os


class CodecError(TypeError):
    """A value that is not made of plain types (or too deep / too large to pass)."""


_SCALARS = (type(None), bool, int, float, str)
_MAX_DEPTH = 100


def encode(value, depth=0):
    """A JSON tree for `value`, which must be made of exact builtin types (no subclasses, so no
    object of the program's with its own `__eq__`, `__hash__` or `__repr__` survives)."""
    if depth > _MAX_DEPTH:
        raise CodecError(f"a value nested deeper than {_MAX_DEPTH} levels")
    kind = type(value)
    if kind in _SCALARS:
        if kind is int and value.bit_length() > 20000:
            raise CodecError("an integer over 20000 bits")
        if kind is int:
            return ["i", str(value)]
        return ["f", repr(value)] if kind is float else ["v", value]
    if kind in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "s", frozenset: "z"}[kind]
        return [tag, [encode(item, depth + 1) for item in value]]
    if kind is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    if kind is bytes:
        return ["b", value.hex()]
    if kind is complex:
        return ["c", repr(value.real), repr(value.imag)]
    raise CodecError(f"a value of type {kind.__name__}, which the tests cannot compare (plain types only)")


def decode(tree):
    tag = tree[0]
    if tag == "v":
        return tree[1]
    if tag == "i":
        return int(tree[1])
    if tag == "f":
        return float(tree[1])
    if tag in ("l", "t", "s", "z"):
        items = [decode(item) for item in tree[1]]
        return {"l": list, "t": tuple, "s": set, "z": frozenset}[tag](items)
    if tag == "d":
        return {decode(k): decode(v) for k, v in tree[1]}
    if tag == "b":
        return bytes.fromhex(tree[1])
    if tag == "c":
        return complex(float(tree[1]), float(tree[2]))
    raise CodecError(f"unknown value tag {tag!r}")


def to_json(value):
    """A functional test's return value as JSON text, plain types only."""

    def check(item, depth):
        if depth > _MAX_DEPTH:
            raise CodecError(f"a value nested deeper than {_MAX_DEPTH} levels")
        kind = type(item)
        if kind in (list, tuple):
            for x in item:
                check(x, depth + 1)
        elif kind is dict:
            for k, v in item.items():
                if type(k) is not str:
                    raise CodecError(f"a dict key of type {type(k).__name__} (JSON keys are strings)")
                check(v, depth + 1)
        elif kind not in _SCALARS:
            raise CodecError(f"a value of type {kind.__name__}, which the tests cannot compare (plain types only)")

    check(value, 0)
    return json.dumps(value)


class Channel:
    """JSON lines over a pair of pipes, read linearly, each message at most `max_bytes`."""

    def __init__(self, read_fd, write_fd, max_bytes):
        self.read_fd, self.write_fd, self.max_bytes = read_fd, write_fd, max_bytes
        self.buffer, self.scanned = bytearray(), 0

    def send(self, message):
        data = (json.dumps(message) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self.write_fd, view) :]

    def receive(self):
        """The next message, or None at end of file; ValueError for an oversized or unreadable one."""
        while True:
            end = self.buffer.find(b"\n", self.scanned)
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 1]
                self.scanned = 0
                message = json.loads(line)
                if not isinstance(message, dict):
                    raise ValueError("not a JSON object")
                return message
            self.scanned = len(self.buffer)
            if len(self.buffer) > self.max_bytes:
                raise ValueError(f"a message over {self.max_bytes} bytes")
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                return None
            self.buffer += chunk
