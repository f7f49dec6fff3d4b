"""Distributed execution of the ops: context parallelism (a sequence split across ranks, states passed along)."""
from kalmix.distributed.context import Piece, context_parallel, packed_piece

__all__ = ["context_parallel", "packed_piece", "Piece"]
