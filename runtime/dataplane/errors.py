"""Errors raised by the data plane. Every failure of a read is a ``TransferError``."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A read could not deliver a verified, untorn copy of the source's published state.

    The destination tensors may hold partial data after this is raised; read again (from this
    peer or another one) before using them.
    """


class SourceGone(TransferError):
    """The source process died, closed its server or dropped the connection mid-transfer."""


class TransferTimeout(TransferError):
    """The read did not finish (or the wanted step was not published) before its deadline."""


class ChecksumMismatch(TransferError):
    """A chunk arrived intact in length but its xxh3 checksum differs, with no concurrent
    republish to explain it: the bytes were corrupted."""


class TornRead(TransferError):
    """The source republished over the slot being read; retried internally, raised only when
    the source keeps republishing faster than a read completes."""


class LayoutMismatch(TransferError, ValueError):
    """The destination tensors do not match the handle's tensor metadata."""
