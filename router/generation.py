"""The public `Generation` service: validate, admit, route, stream text back.

Lifecycle of a request here: validate every field (INVALID_ARGUMENT naming the field) → render a
conversation with the model's chat template (router/chat.py) → tokenise once → admission (a
bounded queue in front of `max_concurrency` slots; RESOURCE_EXHAUSTED beyond it) → choose workers
(UNAVAILABLE if a role has none alive) → run_flow's token events → incremental detokenisation →
stop strings (the text is trimmed and the decode side aborted) → final chunk with finish reason,
usage and timings. The client's deadline bounds every worker call and its cancellation cancels
them. Each step of the way is told to the request's `Lifecycle` (router/lifecycle.py), which keeps
every tracker's account; how it ended (router/outcome.py) becomes the gRPC status here.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import replace

import grpc

from router.chat import ChatTemplate
from router.config import RouterConfig
from router.errors import DEADLINE_MARGIN_S, InvalidArgument, RequestFailed, WorkerFailed
from router.flow import FlowTimings, TokenEvent, remaining, run_flow
from router.ids import new_id
from router.lifecycle import Lifecycle, Tracker
from router.metrics import RouterMetrics
from router.outcome import Outcome
from router.policy import choose_decode, choose_prefill, prefix_key
from router.registry import Worker, WorkerRegistry
from router.slo import Admission
from router.split import PrefillSplit
from router.text import IncrementalDetokenizer, RouterTokenizer, StopMatcher
from router.validation import check_model, validate_prompt, validate_sampling
from splitserve.roles import Role
from splitserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, tokenizer: RouterTokenizer,
                 served_model: str, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.registry = registry
        self.tokenizer = tokenizer
        template = tokenizer.chat_template
        self.chat = (ChatTemplate(template, tokenizer.bos_token, tokenizer.eos_token)
                     if template else None)
        self.served_model = served_model
        self.model_names = frozenset({served_model, *cfg.model_aliases})
        self.rng = random.Random()
        tpot_slo = cfg.tpot_slo_s if cfg.tpot_slo_s is not None else cfg.admit_tpot_slo_s
        self.split = (PrefillSplit(tpot_slo_s=tpot_slo) if cfg.conditional_disaggregation
                      else None)
        self.tracker = Tracker(metrics, Admission(cfg.max_concurrency, cfg.max_queue),
                               cfg.admit_ttft_slo_s, cfg.admit_tpot_slo_s, self.split)

    # -- RPCs ---------------------------------------------------------------------------------
    async def Generate(self, request: generation_pb2.GenerateRequest, context):
        await self._guarded(request, context, context.write)

    async def Complete(self, request: generation_pb2.GenerateRequest, context):
        resp = generation_pb2.CompleteResponse()

        async def merge(chunk: generation_pb2.GenerateResponse) -> None:
            resp.request_id = chunk.request_id
            resp.text += chunk.text
            resp.token_ids.extend(chunk.token_ids)
            resp.logprobs.extend(chunk.logprobs)
            if chunk.HasField("finish_reason"):
                resp.finish_reason = chunk.finish_reason
                resp.usage.CopyFrom(chunk.usage)
                resp.timings.CopyFrom(chunk.timings)
                if chunk.HasField("stop_reason"):
                    resp.stop_reason = chunk.stop_reason

        await self._guarded(request, context, merge)
        return resp

    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context):
        try:
            check_model(request.model, self.model_names)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        return generation_pb2.TokenizeResponse(token_ids=ids, max_model_len=self.cfg.max_model_len)

    async def ListModels(self, request, context):
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(
            name=self.served_model, max_model_len=self.cfg.max_model_len,
            prefill_workers=len(self.registry.alive(Role.PREFILL)),
            decode_workers=len(self.registry.alive(Role.DECODE)) + len(
                self.registry.alive(Role.COLOCATED)))])

    # -- the request ----------------------------------------------------------------------------
    async def _guarded(self, request, context,
                       emit: Callable[[generation_pb2.GenerateResponse], Awaitable[None]]) -> None:
        """The request's outcome as a gRPC status.

        Chunks are written from inside this coroutine rather than yielded to grpc: a client that
        leaves cancels the handler wherever it waits, and if that were grpc's own write, an
        async-generator handler would be left suspended and only closed by the garbage collector
        -- releasing the prefill worker's KV and recording the outcome late, as "error"."""
        life = self.tracker.track()
        try:
            async with contextlib.aclosing(
                    self.stream(request, context.time_remaining(), life)) as chunks:
                async for chunk in chunks:
                    await emit(chunk)
                    life.sent(len(chunk.token_ids), chunk.HasField("finish_reason"))
        except BaseException as e:
            outcome = life.end(e, context.time_remaining())
            if not isinstance(e, RequestFailed):
                raise
            await context.abort(outcome.code, outcome.message,
                                trailing_metadata=grpc_trailers(outcome))
        else:
            life.end()  # counted already, unless the stream ran out without its last chunk

    def prepare(self, request: generation_pb2.GenerateRequest
                ) -> tuple[Sequence[int], common_pb2.SamplingParams, tuple[str, ...]]:
        """Validate and tokenise; shared with the HTTP front. Raises InvalidArgument.

        Token ids stay in the request's own repeated field: the worker requests copy it in C,
        where a Python list would cost a prompt's length to make and again to copy into each
        worker request."""
        check_model(request.model, self.model_names)
        validate_prompt(request, vocab_size=self.tokenizer.vocab_size,
                        max_model_len=self.cfg.max_model_len)
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            ids = request.token_ids.ids
        else:  # a text prompt's length is known only now
            if kind == "messages":  # the template writes the special tokens itself
                if self.chat is None:
                    raise InvalidArgument("messages", f"model {self.served_model!r} has no chat "
                                                      "template; send text or token_ids")
                text = self.chat.render((m.role, m.content) for m in request.messages.messages)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = self.tokenizer.encode(request.text)
            validate_prompt(request, vocab_size=self.tokenizer.vocab_size,
                            max_model_len=self.cfg.max_model_len, prompt_len=len(ids))
        v = validate_sampling(request.sampling, prompt_len=len(ids),
                              max_model_len=self.cfg.max_model_len,
                              vocab_size=self.tokenizer.vocab_size, limits=self.cfg.limits)
        if v.stream_interval < self.cfg.stream_interval:  # the deployment's floor
            v = replace(v, stream_interval=self.cfg.stream_interval)
        return ids, v.to_proto(), v.stop

    def route(self, prompt_len: int, local: bool, exclude: Collection[str] = (),
              prompt_ids: Sequence[int] = ()) -> tuple[Worker | None, Worker]:
        """Workers for a request; `exclude`: ids of workers that already failed it;
        `prompt_ids`: the prompt, for prefix affinity (router/policy.py)."""
        prefill, decode, colocated = (
            [w for w in self.registry.alive(role, self.served_model) if w.worker_id not in exclude]
            for role in (Role.PREFILL, Role.DECODE, Role.COLOCATED))
        pool = prefill or decode or colocated
        # With one worker per role there is nothing to choose: no prefix hashing.
        choice = len(prefill) > 1 or len(decode) + len(colocated) > 1
        key = (prefix_key(prompt_ids, pool[0].capacity.block_size)
               if pool and choice and self.cfg.prefix_affinity else None)
        if prefill and decode and not local and prompt_len >= self.cfg.local_prefill_threshold:
            return (choose_prefill(prefill, prompt_len, key),
                    choose_decode(decode, self.rng, key))
        if decode or colocated:
            return None, choose_decode(decode + colocated, self.rng, key)
        raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                            f"no live worker can serve {self.served_model!r}: {len(prefill)} "
                            f"prefill, {len(decode)} decode, {len(colocated)} colocated"
                            + (f" (besides {', '.join(exclude)}, which failed this request)"
                               if exclude else ""))

    async def stream(self, request: generation_pb2.GenerateRequest, timeout: float | None,
                     life: Lifecycle) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The request as response chunks; raises RequestFailed (InvalidArgument included).
        Shared by the gRPC service and the HTTP front. `timeout`: seconds left to the client."""
        deadline = None if timeout is None else time.monotonic() + max(
            timeout - DEADLINE_MARGIN_S, 0.0)
        rid = request.request_id if request.HasField("request_id") else new_id()
        ids, sp, stops = self.prepare(request)
        await life.admit(rid, len(ids))
        try:
            timings = FlowTimings()
            detok = None if request.skip_detokenize else IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=not request.HasField("skip_special_tokens")
                or request.skip_special_tokens)
            stop = StopMatcher(stops)
            stop_reason, n_out = None, 0
            flow = self._migrating(rid, ids, sp, request.local_prefill, deadline, timings, life)
            try:
                async for ev in flow:
                    n_out += len(ev.token_ids)
                    text = ""
                    if detok is not None:
                        text, stop_reason = stop.feed(detok.push(ev.token_ids))
                    chunk = generation_pb2.GenerateResponse(request_id=rid, token_ids=ev.token_ids,
                                                            text=text)
                    if ev.logprobs:
                        chunk.logprobs.extend(generation_pb2.TokenLogprob(token_id=t, logprob=lp)
                                              for t, lp in zip(ev.token_ids, ev.logprobs))
                    finish = ev.finish_reason
                    if stop_reason is not None:
                        finish = common_pb2.FINISH_REASON_STOP
                    life.received(len(ev.token_ids), finish is not None)
                    if finish is not None:
                        if detok is not None and stop_reason is None:
                            chunk.text += stop.feed(detok.flush())[0] + stop.flush()
                        self._finish(chunk, finish, stop_reason, len(ids), n_out, life, timings)
                    yield chunk
                    if finish is not None:
                        break
            finally:
                await flow.aclose()  # cancels the decode RPC when we stopped early
        finally:
            life.left()

    async def _migrating(self, rid: str, ids: Sequence[int], sp: common_pb2.SamplingParams,
                         local: bool, deadline: float | None, timings: FlowTimings,
                         life: Lifecycle) -> AsyncIterator[TokenEvent]:
        """run_flow's events, surviving worker failures: when a worker fails the request (dies,
        breaks its stream, errs), what is left runs on other workers from the prompt plus the
        tokens already streamed, so the client's stream goes on without a gap or a repeat (with
        greedy sampling, the same tokens). At most `max_migrations` times; then UNAVAILABLE
        naming every worker that failed."""
        failed: list[str] = []
        out: list[int] = []
        while True:
            prefill, decode = self.route(len(ids) + len(out), local, exclude=failed,
                                         prompt_ids=ids)
            prompt = [*ids, *out] if out else ids  # after a migration: what was streamed too
            rest = remaining(sp, len(out))
            placement = None
            if self.split is not None:  # conditional disaggregation (router/split.py)
                placement = self.split.place(prompt, prefill, decode)
                prefill = prefill if placement.remote else None
            life.routed(prefill, decode, placement, rest.max_tokens)
            flow = run_flow(rid, prompt, rest, prefill, decode, deadline, timings)
            try:
                async with contextlib.aclosing(flow):
                    async for ev in flow:
                        out += ev.token_ids
                        yield ev
                return
            except WorkerFailed as e:
                failed.append(e.worker_id)
                if len(failed) > self.cfg.max_migrations:
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                        f"{e} (gave up after {len(failed) - 1} migration(s); "
                                        f"failed workers: {', '.join(failed)})") from e
                life.migrated(e, sp.max_tokens)

    @staticmethod
    def _finish(chunk, finish: int, stop_reason: str | None, n_prompt: int, n_out: int,
                life: Lifecycle, t: FlowTimings) -> None:
        chunk.finish_reason = finish
        if stop_reason is not None:
            chunk.stop_reason = stop_reason
        chunk.usage.CopyFrom(common_pb2.Usage(prompt_tokens=n_prompt, completion_tokens=n_out))
        now, t0 = time.perf_counter(), life.arrival
        chunk.timings.CopyFrom(common_pb2.Timings(
            queue_s=life.queue_s + t.worker_queue_s, prefill_s=t.prefill_s,
            transfer_s=t.transfer_s, decode_s=t.decode_s,
            ttft_s=(t.first_token_at or now) - t0, e2e_s=now - t0))


def grpc_trailers(outcome: Outcome) -> tuple[tuple[str, str], ...]:
    """A refusal's hint of when to come back, as grpc's retry pushback."""
    if outcome.retry_after_s is None:
        return ()
    return (("grpc-retry-pushback-ms", str(math.ceil(outcome.retry_after_s * 1000))),)
