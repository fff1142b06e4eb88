"""The ``torch`` implementation: sparse autograd with embedding_bag / index_add; any device, any float dtype."""

from __future__ import annotations

from .sparse import make_ops, torch_backend

BACKEND = torch_backend()
encode, encode_topk, batch_topk, sparse_decode, encode_aux, gather_pre, encode_above = make_ops(BACKEND)
