"""Distributed execution of the ops and models: context parallelism (a sequence split across ranks, states passed
along; ``context_parallel`` for one op, ``context_parallel_model`` for a whole model)."""
from kalmix.distributed.context import Piece, context_parallel, packed_piece
from kalmix.distributed.model import ContextSplit, context_parallel_loss, context_parallel_model

__all__ = ["context_parallel", "packed_piece", "Piece", "context_parallel_model", "context_parallel_loss",
           "ContextSplit"]
