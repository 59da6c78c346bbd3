"""A server the official ``tinker`` SDK drives: a user's own loop calls ``forward_backward``, ``optim_step``
and ``sample`` on LoRA adapters that llmrl trains and samples (docs/tinker.md).

The SDK's own types (`tinker.types`, pydantic models) are the contract: JSON bodies are validated with
them and answers are built from them; ``forward_backward`` arrives as the SDK's protobuf, and its
result and samples go back as protobuf, as the SDK reads them. Each call that does work answers at
once with a future (``request_id``) that the SDK polls on ``/api/v1/retrieve_future``: the model work
runs on one worker thread in the order the calls arrived, which is the order of each training
client's ``seq_id`` (the SDK sends a client's next call only once the previous one was accepted).
Sampling runs on the embedded engine (`LocalEngine`), one per saved snapshot, serving the base with
the adapter merged in.

Errors: a malformed request gets a 4xx naming the field; a call this server does not serve yet gets a
404 naming the SDK call. The SDK retries 5xx answers for minutes, so nothing the caller can fix is a
5xx.
"""

from llmrl.server.tinker.app import create_tinker_app, serve_tinker
from llmrl.server.tinker.service import TinkerService

__all__ = ["TinkerService", "create_tinker_app", "serve_tinker"]
