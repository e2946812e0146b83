"""Typed errors of the artefact side (vindex format, extraction, slicing, Hub).

Every error a user can cause is one of these; the CLIs print ``str(err)`` on one line and exit
non-zero, never a traceback. Foreign errors (OSError, gguf, safetensors, huggingface_hub) are
translated into these once, at the boundary where they happen.
"""

from __future__ import annotations


class LarqlError(Exception):
    """Base of every error larql-edge raises on purpose."""


class VindexError(LarqlError):
    """A vindex folder is missing, malformed, or corrupt."""


class ChecksumMismatch(VindexError):
    """One or more files do not match the sha256 recorded in index.json."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class SourceError(LarqlError):
    """An extraction source (GGUF, Hugging Face folder, packaged alias) cannot be used."""


class UnsupportedArchitecture(SourceError):
    """The model's architecture is not one of the families larql-edge describes."""


class UnsupportedTensorType(SourceError):
    """A GGUF tensor is stored in a quantization type we cannot dequantize."""


class OutputExists(LarqlError):
    """The output folder exists and --force was not given."""


class SliceError(LarqlError):
    """A slice request is invalid (unknown preset or part, bad destination)."""


class HubError(LarqlError):
    """A Hub operation failed (auth, not found, bad repo id, unsafe remote listing)."""
