"""``precompile.serve_generate``: every forward call of ``model.generate()`` served by
compiled models, with no Dynamo frame in a process whose artifact store is warm.

``generate`` calls the model's forward with a few call structures: the prefill (the
prompt, sequence length varying) and the decode steps (one token each; some versions
add a 4-d attention mask over the static KV cache). transformers' own ``CompileConfig``
takes a ``backend``, but that still runs Dynamo in every process, and it only covers the
decode steps. Here the model's ``forward`` is swapped, on this instance and only inside
the ``with`` block, for a router: each call structure (argument names, which are
tensors, the plain values) gets one ``compile_model`` (found in the artifact store
without tracing where it was compiled before), and ``get_compiled_call`` (generate's
hook for ``torch.compile``) returns the same router, so no step is compiled by
torch.compile.

Dynamic dims: the prompt's sequence dim (``input_ids`` last dim, ``position_ids``'s
last dim of that size, and the query dim of the 4-d mask generate makes for a padded
prefill) when it is longer than 1, with the given ``hints``; a 2-d attention mask is
padded with zeros to the static KV cache's length (as transformers' mask code pads it),
so it has one shape; with ``dynamic_batch=True`` also dim 0 of every tensor argument
(and the KV cache's batch) where the call's batch is over 1, so batch sizes share one
compile.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import logging
import numbers
import operator
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from precompile.runtime import (
    ArtifactNotFoundError,
    CompiledModel,
    IndexOutOfRangeError,
    InputMismatchError,
    InvalidOptionError,
    UnsupportedGraphError,
)
from precompile.runtime.compiler_interface import (
    cudagraph_options,
    is_kv_cache,
    kv_cache_capacities,
    kv_cache_capacity,
    tree_flatten,
)

from ._generate_loop import KEPT_CACHES, DecodeLoops, holds_tokens, loop_request
from ._model import compile_model
from ._variant_plan import check_kinds

log = logging.getLogger("precompile.compile")
_PLAIN = (bool, int, float, str, type(None))
_SEQUENCE_ARGUMENTS = ("attention_mask", "position_ids", "token_type_ids")
_SIGNATURES_KEPT = 256


def _structure(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two forward calls the same compiled call: argument names, which are
    tensors (their rank, dtype and device), KV caches, and the plain values."""
    if args:
        raise UnsupportedGraphError(
            f"serve_generate serves keyword calls (generate's); got {len(args)} positional"
        )
    parts: list[Any] = []
    for name, value in sorted(kwargs.items()):
        leaves, spec = tree_flatten(value, is_leaf=is_kv_cache)
        kinds: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                kinds.append(("tensor", leaf.dim(), leaf.dtype, leaf.device))
            elif is_kv_cache(leaf):
                kinds.append(("cache", type(leaf).__qualname__))
            elif isinstance(leaf, _PLAIN):
                kinds.append(("value", type(leaf).__name__, leaf))
            else:
                raise UnsupportedGraphError(
                    f"generate passed {name} holding a {type(leaf).__name__}, which "
                    "compile_model cannot take as an argument"
                )
        parts.append((name, str(spec), tuple(kinds)))
    return tuple(parts)


def _tensor_dims(name: str, value: torch.Tensor, sequence: int, dynamic_batch: bool) -> list[int]:
    """The dims of one tensor of argument ``name`` that follow the call's batch (with
    ``dynamic_batch``) or the prompt's length."""
    wanted: list[int] = []
    if dynamic_batch and value.dim() >= 1 and int(value.shape[0]) > 1:
        wanted.append(0)
    if sequence > 1:
        if name == "input_ids" or (
            name in _SEQUENCE_ARGUMENTS and value.dim() == 2 and int(value.shape[-1]) == sequence
        ):
            wanted.append(value.dim() - 1)
        elif name == "attention_mask" and value.dim() == 4 and int(value.shape[2]) == sequence:
            wanted.append(2)  # the 4-d mask generate makes: [batch, 1, query (the prompt), key]
        elif name == "inputs_embeds":
            wanted.append(1)
    return wanted


def _dynamic(kwargs: Mapping[str, Any], dynamic_batch: bool) -> dict[int | str, list[int]]:
    dims: dict[int | str, list[int]] = {}
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = kwargs.get("inputs_embeds")
    sequence = int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 1
    for name, value in kwargs.items():
        wanted: list[int] = []
        if isinstance(value, torch.Tensor):
            wanted = _tensor_dims(name, value, sequence, dynamic_batch)
        elif isinstance(value, Mapping) and value and not is_kv_cache(value):
            # generate's masks prepared per layer type ({"full_attention": [b, 1, q, k]},
            # Qwen2 and every model whose config has layer_types): compile_model makes the
            # dims dynamic in each tensor of the argument, so only dims all of them share
            tensors = [v for v in value.values() if isinstance(v, torch.Tensor)]
            if tensors:
                shared = set(_tensor_dims(name, tensors[0], sequence, dynamic_batch))
                for tensor in tensors[1:]:
                    shared &= set(_tensor_dims(name, tensor, sequence, dynamic_batch))
                wanted = sorted(shared)
        elif (
            is_kv_cache(value)
            and dynamic_batch
            and isinstance(ids, torch.Tensor)
            and int(ids.shape[0]) > 1
        ):
            wanted.append(0)
        if wanted:
            dims[name] = sorted(set(wanted))
    return dims


def _static_sizes(kwargs: Mapping[str, Any], dynamic_batch: bool) -> tuple[Any, ...]:
    """The sizes a call's compiled model holds fixed: every tensor dim not made dynamic,
    and each KV cache's max_cache_len. A call differing in one of them (another KV cache
    length, say: ``generate`` sizes its static KV cache to prompt + new tokens) is another
    compiled model, never a call the first one refuses."""
    dims = _dynamic(kwargs, dynamic_batch)
    sizes: list[Any] = []
    for name, value in sorted(kwargs.items()):
        if is_kv_cache(value):
            sizes.append((name, kv_cache_capacities(value)))
            continue
        dynamic = set(dims.get(name, ()))
        leaves = tree_flatten(value, is_leaf=is_kv_cache)[0]  # a dict of masks: each one
        sizes.append((name, tuple(
            tuple(None if d in dynamic else int(n) for d, n in enumerate(leaf.shape))
            for leaf in leaves if isinstance(leaf, torch.Tensor)
        )))  # fmt: skip
    return tuple(sizes)


def _call_signature(kwargs: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What ``_structure`` and ``_static_sizes`` read, in a form cheap enough for every
    decode step: each argument's name, a tensor's whole shape, a KV cache's type and its
    layers' lengths, a plain value with its type (a tensor's dtype and device too). Equal
    signatures have equal keys, so a
    signature seen before names its compiled model without the full key (which flattens
    every argument). None where an argument is anything else: the full key decides."""
    parts: list[Any] = []
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            parts.append((name, value.shape, value.dtype, value.device))
        elif (
            type(value) is dict
            and value
            and all(isinstance(v, torch.Tensor) for v in value.values())
        ):  # generate's masks by layer type
            parts.append((name, dict, tuple((k, v.shape, v.dtype, v.device)
                                            for k, v in value.items())))  # fmt: skip
        elif is_kv_cache(value):
            parts.append((name, type(value), kv_cache_capacities(value)))
        elif isinstance(value, _PLAIN):
            parts.append((name, type(value), value))
        else:
            return None
    return tuple(parts)


def _pad_mask_to_kv_cache(kwargs: dict[str, Any]) -> None:
    """A 2-d attention mask (batch, tokens so far), which grows by one every decode step,
    padded with zeros to the static KV cache's length: what transformers' mask code does to
    it anyway (the positions past the tokens so far are masked), so every decode step
    has one shape and one CUDA graph."""
    mask = kwargs.get("attention_mask")
    kv_cache = kwargs.get("past_key_values")
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and is_kv_cache(kv_cache)):
        return
    lengths = set(kv_cache_capacities(kv_cache))
    if len(lengths) != 1:
        return
    (length,) = lengths
    if isinstance(length, int) and mask.shape[1] < length:
        kwargs["attention_mask"] = torch.nn.functional.pad(mask, (0, length - mask.shape[1]))


class _OnThisInstance:
    """What ``serve_generate`` installs on one model instance (its ``forward``, its
    ``get_compiled_call``). A deep copy of the model (``copy.deepcopy`` inside the block)
    gets its class's own method instead: this one serves compiled models bound to the
    original's weights, which a copy may have changed (its outputs were the original's).
    A shallow copy shares the original's parameters and submodules, so it is served as
    the original is."""

    def __init__(self, model: torch.nn.Module, name: str, function: Any) -> None:
        self._model = model
        self._name = name
        self._function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copied = memo.get(id(self._model))
        if copied is None:  # copied alone, without its model: nothing to serve
            return getattr(type(self._model), self._name).__get__(self._model)
        return getattr(type(copied), self._name).__get__(copied)


class GenerateServer:
    """The router ``serve_generate`` installs: one compiled model per call structure.
    ``calls``: forward calls served by compiled models; ``compiled``: per structure;
    ``stats``: which loop answered each ``generate`` and why."""

    def __init__(
        self,
        model: torch.nn.Module,
        dynamic_batch: bool,
        options: Mapping[str, Any],
        loop: bool = True,
        kept_caches: int = KEPT_CACHES,
    ) -> None:
        self.model = model
        self.dynamic_batch = dynamic_batch
        self.options = dict(options)
        self.loops = DecodeLoops(model, dynamic_batch, kept_caches) if loop else None
        self._loop_generates = 0
        self._fallbacks: collections.Counter[str] = collections.Counter()
        self._loop_refused: dict[tuple[Any, ...], str] = {}
        self.compiled: dict[tuple[Any, ...], CompiledModel] = {}
        # call structures that could not be compiled: refused again without a new trace
        self._refused: dict[tuple[Any, ...], UnsupportedGraphError] = {}
        # call signature -> compiled model, for calls whose signature was seen before
        self._by_signature: dict[tuple[Any, ...], CompiledModel] = {}
        self.calls = 0
        self._lock = threading.RLock()
        self._saved: dict[str, Any] = {}
        self._installed = False
        self._prepared = False  # prepare() ran: a new structure is no longer expected
        self._compile_others = True
        self._unprepared_compiles = 0
        self._preparing = threading.local()  # set in the thread running prepare()
        self._writing: set[int] = set()  # ids of the passed KV caches being generated into
        # transformers' kept static cache length after prepare (a refused request moved it)
        self._prepared_cache_length: Any = None

    @property
    def stats(self) -> dict[str, Any]:
        """``generate`` calls answered by the compiled loop (``loop_generates``) and by
        transformers' loop (``fallbacks``: the count per reason); ``calls``: forward
        calls served by compiled models; ``unprepared_compiles``: structures compiled in
        front of a request after ``prepare``; ``kept_caches``: the loop's free KV caches
        kept now, ``dropped_caches``: those its bound dropped."""
        with self._lock:
            loops = self.loops
            return {"loop_generates": self._loop_generates, "fallbacks": dict(self._fallbacks),
                    "calls": self.calls,
                    "unprepared_compiles": self._unprepared_compiles,
                    "kept_caches": loops.kept() if loops else 0,
                    "dropped_caches": loops.dropped if loops else 0}  # fmt: skip

    # -- the hook ----------------------------------------------------------------------
    def __enter__(self) -> GenerateServer:
        if self._installed:
            raise InvalidOptionError("serve_generate is already installed on this model")
        model = self.model
        if isinstance(vars(model).get("forward"), _OnThisInstance):
            raise InvalidOptionError(
                "another serve_generate block already serves this model: blocks on one "
                "model do not nest (leave the first before entering another)"
            )
        original = type(model).forward.__get__(model)
        for name in _INSTALLED:
            if name in vars(model):
                self._saved[name] = vars(model)[name]

        forward = _OnThisInstance(model, "forward", self)
        functools.update_wrapper(forward, original)  # generate reads forward's signature
        model.forward = forward  # type: ignore[method-assign]
        model.get_compiled_call = _OnThisInstance(  # type: ignore[method-assign]
            model, "get_compiled_call", lambda compile_config=None: model.__call__
        )
        if self.loops is not None:
            generate = _OnThisInstance(model, "generate", self._generate)
            functools.update_wrapper(generate, type(model).generate.__get__(model))
            model.generate = generate  # type: ignore[method-assign]
        self._installed = True
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._uninstall()

    def _uninstall(self) -> None:
        for name in _INSTALLED:
            vars(self.model).pop(name, None)
            if name in self._saved:
                setattr(self.model, name, self._saved[name])
        self._installed = False

    # -- serving -----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            _no_output_capturing(kwargs)
        ids = kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.numel() == 0:
            _no_new_tokens(ids, kwargs)
        _pad_mask_to_kv_cache(kwargs)
        signature = None if args else _call_signature(kwargs)
        compiled = self._by_signature.get(signature) if signature is not None else None
        if compiled is None:
            key = (*_structure(args, kwargs), _static_sizes(kwargs, self.dynamic_batch))
            compiled = self.compiled.get(key)
            if compiled is None:
                compiled = self._compile(key, kwargs)
            if signature is not None:
                if len(self._by_signature) >= _SIGNATURES_KEPT:  # prompt lengths, mostly
                    self._by_signature.clear()
                self._by_signature[signature] = compiled
        if not self._in_prepare():  # prepare's own runs are not requests
            self.calls += 1
        return compiled(**kwargs)

    def _compile(self, key: tuple[Any, ...], kwargs: Mapping[str, Any]) -> CompiledModel:
        for name, value in kwargs.items():
            if is_kv_cache(value) and hasattr(value, "cross_attention_cache"):
                raise UnsupportedGraphError(
                    f"generate passed {name} as a {type(value).__name__}: an encoder-decoder "
                    f"model ({type(self.model).__name__}), whose cross-attention cache is "
                    "filled at the first decoder step and marked filled by a Python flag per "
                    "layer, which a compiled graph would be fixed to; serve_generate does not "
                    "serve encoder-decoder models yet: call generate outside the block"
                )
            if is_kv_cache(value) and kv_cache_capacity(value) is None:
                raise UnsupportedGraphError(
                    f"generate passed {name} as a {type(value).__name__}, whose length grows "
                    "every step; serve_generate serves static caches: call generate with "
                    "cache_implementation='static' (or past_key_values=StaticCache(...))"
                )
        _tokens_in_vocabulary(self.model, kwargs)  # else the trace's eager run raises
        with self._lock:
            found = self.compiled.get(key)
            if found is not None:
                return found
            if key in self._refused:
                raise self._refused[key]
            what = _describe_call(kwargs)
            try:
                with self._own_forward(), self._unless_refused(what) as options:
                    compiled = compile_model(
                        self.model, (), dict(kwargs),
                        dynamic=_dynamic(kwargs, self.dynamic_batch), **options,
                    )  # fmt: skip
            except UnsupportedGraphError as exc:
                refused = UnsupportedGraphError(_refusal(kwargs, self.dynamic_batch, exc))
                self._refused[key] = refused
                raise refused from exc
            log.info("serve_generate: compiled call structure %s", [k[0] for k in key])
            self.compiled[key] = compiled
            return compiled

    @contextlib.contextmanager
    def _own_forward(self) -> Iterator[None]:
        """The model's own methods while it is traced (or keyed)."""
        model = self.model
        installed = {n: vars(model).pop(n) for n in _INSTALLED if n in vars(model)}
        try:
            yield
        finally:
            for name, value in installed.items():
                setattr(model, name, value)

    def _in_prepare(self) -> bool:
        """Whether this thread is running ``prepare`` (its runs are no requests)."""
        return bool(getattr(self._preparing, "active", False))

    @contextlib.contextmanager
    def _unless_refused(self, what: str) -> Iterator[Mapping[str, Any]]:
        """compile_model's options for a structure not built yet. After ``prepare`` it is
        one no request was expected to need: compiled in front of this request with a
        warning, or, where ``prepare`` said not to compile others, only found in the
        artifact store (``compile=False``), else refused naming it."""
        if not self._prepared or self._in_prepare():
            yield self.options
            return
        if self._compile_others:
            log.warning(
                "serve_generate: %s was not prepared; this request waits for its compile", what
            )
            self._unprepared_compiles += 1
            yield self.options
            return
        try:
            yield {**self.options, "compile": False}
        except ArtifactNotFoundError as exc:
            # transformers kept the refused request's longer cache length for this model:
            # put the prepared one back, or every later request would miss it too
            _set_kept_cache_length(self.model, self._prepared_cache_length)
            raise ArtifactNotFoundError(
                f"serve_generate: {what} is not among the prepared shapes, and "
                f"prepare(compile_others=False) compiles nothing in front of a request ({exc})",
                key=exc.key,
            ) from exc

    # -- before the first request ------------------------------------------------------
    def prepare(
        self,
        batch_sizes: Sequence[int],
        prompt_lengths: Sequence[int],
        *,
        max_new_tokens: int,
        compile_others: bool = True,
        **generate_options: Any,
    ) -> PreparedShapes:
        """Build every call structure that requests of these shapes make, before any
        request: one ``model.generate`` per batch size and prompt length, on made-up
        prompts of a token that is no special token, with an all-ones attention mask and
        ``generate_options`` (they choose the structures: pass what your requests pass,
        ``do_sample`` and the KV cache included; ``max_new_tokens`` sizes the cache that
        ``cache_implementation="static"`` makes). With ``cudagraphs`` their graphs are
        captured too. Afterwards a request of a prepared shape compiles nothing; any
        other compiles in front of its request with a warning (``stats``'
        ``unprepared_compiles``), or, with ``compile_others=False``, is only looked up
        in the artifact store and else refused (``ArtifactNotFoundError`` naming it).
        The caller's random generators are left as they were."""
        if not self._installed:
            raise InvalidOptionError("prepare runs inside the serve_generate block")
        batches = _positive_ints(batch_sizes, "batch_sizes")
        lengths = _positive_ints(prompt_lengths, "prompt_lengths")
        (max_new_tokens,) = _positive_ints([max_new_tokens], "max_new_tokens", scalar=True)
        if not isinstance(compile_others, bool):
            raise InvalidOptionError(
                f"compile_others must be True or False, got {compile_others!r}"
            )
        given = sorted({"input_ids", "attention_mask", "inputs"} & set(generate_options))
        if given:
            raise InvalidOptionError(
                f"prepare makes the prompts itself (batch_sizes x prompt_lengths); got {given}"
            )
        caches = [v for v in generate_options.values() if is_kv_cache(v)]
        for cache in caches:
            if _cache_tokens(cache):
                raise InvalidOptionError(
                    f"prepare takes an empty KV cache; the {type(cache).__name__} given holds "
                    f"{_cache_tokens(cache)} tokens (reset() it, as a request would need)"
                )
        device = _device_of(self.model)
        token = _plain_token(self.model)
        kept = vars(self.model).get(_KEPT_CACHE_LENGTH)
        with self._lock:
            before = len(self.compiled) + (len(self.loops.compiled) if self.loops else 0)
        started = time.perf_counter()
        self._preparing.active = True
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                for batch in batches:
                    # the longest first: the static cache transformers sizes for it is kept
                    # for this model and serves the shorter ones (no cache length of their own)
                    for length in sorted(lengths, reverse=True):
                        ids = torch.full((batch, length), token, dtype=torch.long, device=device)
                        try:
                            self.model.generate(
                                input_ids=ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=max_new_tokens, **generate_options,
                            )  # fmt: skip
                        finally:
                            for cache in caches:  # the caller's cache, left as it was
                                cache.reset()
        except BaseException:
            _set_kept_cache_length(self.model, kept)  # a failed prepare changes nothing
            raise
        finally:
            self._preparing.active = False
        with self._lock:
            after = len(self.compiled) + (len(self.loops.compiled) if self.loops else 0)
            self._prepared = True
            self._compile_others = compile_others
            self._prepared_cache_length = vars(self.model).get(_KEPT_CACHE_LENGTH)
        prepared = PreparedShapes(
            tuple((b, n) for b in batches for n in lengths), after - before,
            time.perf_counter() - started,
        )  # fmt: skip
        log.info("serve_generate: prepared %s", prepared)
        return prepared

    # -- generate on the compiled loop (loop=True) --------------------------------------
    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        """A ``generate`` on the compiled loop where it implements the call's settings,
        else on transformers' loop. Under ``no_grad``, as transformers' ``generate`` is
        (its decorator): the loop, which writes its KV cache, is then compiled whatever
        the caller's grad mode."""
        with torch.no_grad():
            return self._generate_without_grad(args, kwargs)

    def _generate_without_grad(self, args: Any, kwargs: Mapping[str, Any]) -> Any:
        passed = next((v for k, v in kwargs.items() if k in _CACHE_ARGUMENTS and is_kv_cache(v)),
                      None)  # fmt: skip
        if passed is None:
            return self._route(args, kwargs)
        # one generate per passed cache at a time, on either loop: the compiled loop refuses
        # a second, and transformers' loop, which a refusal falls back to, would write the
        # cache under the first (tokens of neither request; a race in a trace)
        with self._lock:
            if id(passed) in self._writing:
                raise InvalidOptionError(
                    "the KV cache passed is being written by another generate (in another "
                    "thread): a cache serves one generate at a time; give each its own cache"
                )
            self._writing.add(id(passed))
        try:
            return self._route(args, kwargs)
        finally:
            with self._lock:
                self._writing.discard(id(passed))

    def _route(self, args: Any, kwargs: Mapping[str, Any]) -> Any:
        assert self.loops is not None
        request = loop_request(self.model, args, kwargs)
        if isinstance(request, str):
            return self._transformers_loop(request, args, kwargs)
        key = self.loops.key(request)
        with self._lock:
            compiled = self.loops.compiled.get(key)
            if compiled is None and key in self._loop_refused:
                return self._transformers_loop(self._loop_refused[key], args, kwargs)
            if compiled is None:
                # as the router's first request: refused before a compile it would not use
                _tokens_in_vocabulary(self.model, {"input_ids": request.input_ids})
                if request.kv_cache is not None and holds_tokens(request.kv_cache):
                    # transformers continues it: the loop would refuse it after its compile
                    # (checked here only before a compile: it reads the device)
                    return self._transformers_loop("a KV cache holding tokens", args, kwargs)
                what = (f"the compiled loop of batch {int(request.input_ids.shape[0])}, KV "
                        f"cache length {request.capacity}")  # fmt: skip
                try:
                    with self._own_forward(), self._unless_refused(what) as options:
                        compiled = self.loops.compile(key, request, options)
                except UnsupportedGraphError as exc:
                    why = "the decode loop could not be compiled"
                    log.info("serve_generate: %s (%s); transformers' loop runs these calls",
                             why, str(exc)[:300])  # fmt: skip
                    self._loop_refused[key] = why
                    return self._transformers_loop(why, args, kwargs)
            kept = request.kv_cache is None
            held = self.loops.cache_key(request)
            kv_cache = self.loops.take_cache(held, request.capacity) if kept else request.kv_cache
        try:
            tokens = compiled.generate(
                request.input_ids, kv_cache, max_new_tokens=request.max_new_tokens,
                **request.sampling(),
            )  # fmt: skip
        except (InvalidOptionError, InputMismatchError) as exc:
            # refused before its first write (a cache holding tokens; a cache of another
            # dtype or batch): transformers' loop answers it as it would
            log.debug("serve_generate: the compiled loop refused a generate: %s", exc)
            why = f"the compiled loop refused it ({type(exc).__name__})"
            return self._transformers_loop(why, args, kwargs)
        finally:
            if kept:
                with self._lock:
                    self.loops.give_back(held, kv_cache, pin=self._in_prepare())
        with self._lock:
            if not self._in_prepare():
                self._loop_generates += 1
        return tokens

    def _transformers_loop(self, why: str, args: Any, kwargs: Mapping[str, Any]) -> Any:
        """transformers' own ``generate``, each forward served by the router."""
        log.debug("serve_generate: transformers' loop runs this generate: %s", why)
        with self._lock:
            if not self._in_prepare():
                self._fallbacks[why] += 1
        return type(self.model).generate(self.model, *args, **kwargs)


_INSTALLED = ("forward", "get_compiled_call", "generate")
_CACHE_ARGUMENTS = ("past_key_values", "cache")  # where generate takes a KV cache


def _tokens_in_vocabulary(model: torch.nn.Module, kwargs: Mapping[str, Any]) -> None:
    """A first request of a call structure with a token outside the model's embedding is
    refused as every later one is (``IndexOutOfRangeError`` naming ``input_ids``), before
    anything is traced; it raised eager's IndexError from the compile's eager run."""
    ids = kwargs.get("input_ids")
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    rows = getattr(embeddings, "num_embeddings", None)
    if not isinstance(ids, torch.Tensor) or not isinstance(rows, int) or ids.numel() == 0:
        return
    if ids.dtype.is_floating_point or ids.dtype.is_complex:
        return  # not token ids: the compile says what is wrong with them
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        raise IndexOutOfRangeError(
            f"input_ids holds {bad}, outside the embedding's {rows} rows (its values must lie "
            f"in [0, {rows}))",
            input_name="input_ids",
            expected=range(rows),
            got=bad,
        )


def _refusal(kwargs: Mapping[str, Any], dynamic_batch: bool, error: Exception) -> str:
    """Which of generate's calls could not be compiled, and why."""
    message = f"serve_generate could not compile {_describe_call(kwargs)}: {error}"
    specialized = getattr(error, "specialized", None)
    if dynamic_batch and specialized is not None and specialized[1] == 0:
        message += (
            "; serve_generate(dynamic_batch=False) compiles each batch size apart, where "
            "the model's code fixes the batch"
        )
    return message


def _describe_call(kwargs: Mapping[str, Any]) -> str:
    """One of generate's forward calls, as a log or an error names it."""
    ids = kwargs.get("input_ids")
    phase = "call"
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        phase = "decode step" if int(ids.shape[1]) == 1 else "prefill"
        phase += f" of batch {int(ids.shape[0])}"
    return f"generate's {phase} (a call of {', '.join(sorted(kwargs))})"


@dataclass(frozen=True)
class PreparedShapes:
    """What ``GenerateServer.prepare`` built: the (batch, prompt length) shapes it ran,
    the call structures it compiled or loaded (``structures``; 0 where an earlier
    prepare or request had built them all) and the seconds it took."""

    shapes: tuple[tuple[int, int], ...]
    structures: int
    seconds: float


def _positive_ints(values: Any, name: str, *, scalar: bool = False) -> list[int]:
    """``values`` as a non-empty list of ints of at least 1 (numpy's ints too), else
    refused naming it; ``scalar``: ``values`` holds the one value of an int argument."""
    wanted = "an int" if scalar else "ints"
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise InvalidOptionError(f"{name} must be a non-empty list of ints, got {values!r:.80}")
    found: list[int] = []
    for value in values:
        try:
            number = operator.index(value) if not isinstance(value, bool) else 0
        except TypeError:
            number = 0
        if number < 1:
            raise InvalidOptionError(f"{name} must be {wanted} of at least 1, got {value!r:.40}")
        found.append(number)
    return found


_KEPT_CACHE_LENGTH = "_previous_max_cache_length"  # transformers' kept static cache length


def _set_kept_cache_length(model: torch.nn.Module, length: Any) -> None:
    """Put transformers' kept static cache length of ``model`` back to ``length``."""
    if length is None:
        vars(model).pop(_KEPT_CACHE_LENGTH, None)
    else:
        setattr(model, _KEPT_CACHE_LENGTH, length)


def _no_output_capturing(kwargs: Mapping[str, Any]) -> None:
    """Refuse a forward that asks for attentions or hidden states before anything runs:
    transformers captures them with forward hooks it installs on the model at such a
    call and leaves installed, and the compiled models refuse a model hooked after
    binding, so one such request sent every later one off the compiled loop."""
    asked = [name for name in ("output_attentions", "output_hidden_states") if kwargs.get(name)]
    raise UnsupportedGraphError(
        f"generate asked for {' and '.join(asked)}: serve_generate serves logits only (the "
        "model's output capturing does not trace as one graph); call generate outside the "
        "block for them"
    )


def _no_new_tokens(ids: torch.Tensor, kwargs: Mapping[str, Any]) -> None:
    """Refuse a forward of no tokens, by name: transformers' ``generate`` passes the prompt
    past what its KV cache holds, so a cache holding at least the prompt's tokens (one
    left from another request) leaves none. Eager fails inside the model
    (``cannot reshape tensor of 0 elements``); a compile of it failed in Dynamo's trace."""
    held = max((_cache_tokens(v) for v in kwargs.values() if is_kv_cache(v)), default=0)
    if ids.shape[0] == 0:
        why = "a batch of no rows"
    elif held:
        why = (f"no tokens past the {held} tokens its KV cache holds: the cache continues "
               "only a prompt that begins with those; reset() it or pass a fresh one")  # fmt: skip
    else:
        why = "no tokens to run"
    raise InputMismatchError(
        f"generate passed input_ids of shape {tuple(ids.shape)}: {why}",
        input_name="input_ids",
        expected="at least one row and one token",
        got=tuple(ids.shape),
    )


def _cache_tokens(cache: Any) -> int:
    """The tokens a KV cache holds (0 where it cannot say)."""
    length = getattr(cache, "get_seq_length", None)
    try:
        return int(length()) if callable(length) else 0
    except Exception:  # a cache of another kind: the compile says what is wrong with it
        return 0


def _device_of(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _plain_token(model: torch.nn.Module) -> int:
    """The smallest token id that is none of the model's special tokens (pad, EOS, BOS,
    decoder start): a made-up prompt of it is never masked nor ends generation."""
    special: set[int] = set()
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        for field in ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id"):
            value = getattr(config, field, None)
            values = value if isinstance(value, (list, tuple)) else [value]
            special.update(v for v in values if isinstance(v, int))
    token = 0
    while token in special:
        token += 1
    return token


_OPTIONS = frozenset(
    name
    for name, parameter in inspect.signature(compile_model).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "dynamic"
)


def serve_generate(
    model: torch.nn.Module,
    *,
    dynamic_batch: bool = False,
    loop: bool = True,
    kept_caches: int = KEPT_CACHES,
    **options: Any,
) -> GenerateServer:
    """A context manager under which ``model.generate(...)`` runs on compiled models
    (with ``options``: ``hints``, ``sizes``, ``cache``, ``cudagraphs``, ``compile``,
    ``warmup``...). Use a static KV cache: ``model.generate(ids,
    cache_implementation="static")`` or ``past_key_values=StaticCache(...)``::

        with precompile.serve_generate(model, hints=[16, 256]) as served:
            out = model.generate(ids, max_new_tokens=32, cache_implementation="static")

    A ``generate`` whose settings the compiled decode loop implements (greedy or sampling
    with temperature/top-k/top-p, EOS, one prompt length per batch, a static KV cache)
    runs on it, ``CompiledModel.generate``, with no transformers Python per step (on an
    H200, 3.6x faster per token than the route below, and sooner ready). Any other, and
    every one with ``loop=False``, runs transformers' loop with each forward call on a
    ``compile_model`` per call structure (a fixed ``max_cache_len`` keeps one compile for
    every length of prompt and output); why is counted in ``served.stats``
    (docs/decode.md). ``kept_caches``: how many free KV caches the compiled loop keeps
    for later requests besides those ``prepare`` made (least recently used dropped).
    """
    if not isinstance(model, torch.nn.Module):
        raise InvalidOptionError(
            f"serve_generate takes a torch.nn.Module, got {type(model).__name__}"
        )
    if "dynamic" in options:
        raise InvalidOptionError(
            "serve_generate chooses the dynamic dims itself (the prompt's sequence dim; "
            "dynamic_batch=True for the batch)"
        )
    if not isinstance(dynamic_batch, bool):
        raise InvalidOptionError(f"dynamic_batch must be True or False, got {dynamic_batch!r}")
    if not isinstance(loop, bool):
        raise InvalidOptionError(f"loop must be True or False, got {loop!r}")
    if (
        isinstance(kept_caches, bool)
        or not isinstance(kept_caches, numbers.Integral)
        or (kept_caches < 0)
    ):
        raise InvalidOptionError(
            f"kept_caches must be a count of KV caches (0 or more), got {kept_caches!r}"
        )
    kept_caches = int(kept_caches)  # a numpy integer too
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise InvalidOptionError(
            f"serve_generate got unknown options {unknown}; it takes compile_model's: "
            f"{sorted(_OPTIONS)}"
        )
    check_kinds(options.get("hints"), options.get("sizes"))  # checked now, not at a call
    cudagraph_options(options.get("cudagraphs"))
    return GenerateServer(model, dynamic_batch, options, loop, kept_caches)
