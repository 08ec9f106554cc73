"""Checkpoint tensors into a model's parameters through each parameter's ``weight_loader``, with coverage.

Every parameter of the shared layers carries ``weight_loader(param, loaded, shard_id=None, ...)``:
it copies a checkpoint tensor (or this rank's slice of it) into the right part of ``param`` and
returns the index into ``param`` it wrote (``()`` for all of it; None when the tensor belongs to
another rank). Parameters without one (plain ``nn.Parameter``\\ s of a model) use
``default_weight_loader``. ``CheckpointLoader`` resolves names, calls the loaders, and counts a
parameter as loaded once every one of its rows has been written.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from armillary.errors import WeightLoadError

Index = tuple  # an index into a parameter: ints and slices over its leading dimensions
Piece = tuple[str, torch.Tensor, dict[str, Any]]  # (parameter name, values, weight_loader keyword arguments)


def show_index(index: Index | None) -> str:
    """``[0:8, 3]``-style text of an index, for error messages."""
    if not index:
        return ""
    parts = [f"{i.start}:{i.stop}" if isinstance(i, slice) else str(i) for i in index]
    return "[" + ", ".join(parts) + "]"


def copy_checked(param: nn.Parameter, index: Index, loaded: torch.Tensor, what: str = "") -> Index:
    """``param.data[index].copy_(loaded)`` after checking the shapes agree; returns ``index``."""
    target = param.data[index]
    if target.shape != loaded.shape:
        raise WeightLoadError(f"{what or 'parameter'}{show_index(index)} expects shape {tuple(target.shape)}, "
                              f"the checkpoint tensor has {tuple(loaded.shape)}")
    with torch.no_grad():
        target.copy_(loaded)
    return index


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> Index:
    """The whole tensor, same shape (any dtype: cast on copy). Takes no shard."""
    if shard_id is not None:
        raise WeightLoadError(f"a plain parameter of shape {tuple(param.shape)} takes no shard (got {shard_id!r})")
    return copy_checked(param, (), loaded)


def weight_loader_of(param: nn.Parameter) -> Callable[..., Index | None]:
    return getattr(param, "weight_loader", default_weight_loader)


class LoadedRows:
    """Which rows of each parameter have been written: entries of a vector, slices over all
    dimensions but the last of anything larger (loaders write whole rows)."""

    def __init__(self) -> None:
        self.masks: dict[str, torch.Tensor] = {}

    def mark(self, name: str, param: torch.Tensor, index: Index | None) -> None:
        if index is None:
            return
        mask = self.masks.get(name)
        if mask is None:
            mask = self.masks[name] = torch.zeros(param.shape[:-1] if param.dim() > 1 else param.shape,
                                                  dtype=torch.bool)
        mask[tuple(index)[: mask.dim()]] = True

    def complete(self) -> set[str]:
        """Names of the parameters every row of which has been written."""
        return {name for name, mask in self.masks.items() if bool(mask.all())}


class CheckpointLoader:
    """Loads checkpoint tensors, named as the model's parameters (after any prefix renaming), into ``model``.

    A name goes to the nearest enclosing module that defines
    ``checkpoint_pieces(local_name, tensor) -> list[Piece] | None`` and answers (names relative to
    that module; e.g. attention maps ``q_proj.weight`` to ``qkv_proj.weight`` shard "q", a
    ``FusedMoE`` maps ``3.up_proj.weight`` to expert 3 of ``gate_up_proj``); failing that, to the
    parameter of the same name, loaded whole. Loading goes through each parameter's weight_loader.
    A model's ``load_weights`` is then a few lines::

        loader = CheckpointLoader(self)
        unknown = [name for name, t in weights if loader.load(rename(name), t, source=name) is None]
        if unknown:
            raise WeightLoadError(f"checkpoint tensors the model does not know: {unknown}")
        return loader.loaded()  # the engine raises on any parameter not completely written

    Quantized checkpoints store tensors beside a weight (``q_proj.weight_scale``,
    ``q_proj.weight_scale_2``, ``q_proj.weight_packed``) that a module's ``checkpoint_pieces`` may
    only map for ``weight``: such a tensor goes where its module's weight goes. One with rows (a
    group scale, a packed weight) is mapped as if it were the weight, the parameter renamed from
    ``<target>.weight`` to ``<target>.<attr>``; a per-tensor value (one element) goes to
    ``<target>.<attr>`` of every piece its module's weight was mapped to (a fused checkpoint
    tensor's scale to each of its slots), waiting for that weight if it comes later.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.mappers = {n: m for n, m in model.named_modules() if hasattr(m, "checkpoint_pieces")}
        self.rows = LoadedRows()
        self.routes: dict[str, list[tuple[str, dict[str, Any]]]] = {}  # checkpoint module -> where its weight went
        self.pending: dict[str, list[tuple[str, torch.Tensor, str]]] = {}  # per-tensor values awaiting their weight

    def pieces(self, name: str, tensor: torch.Tensor) -> list[Piece] | None:
        """Where ``name`` goes: (parameter name, values, loader kwargs) per piece; None if nowhere."""
        module_name = name.rpartition(".")[0]
        while module_name:
            mapper = self.mappers.get(module_name)
            if mapper is not None:
                found = mapper.checkpoint_pieces(name[len(module_name) + 1:], tensor)
                if found is not None:
                    return [(f"{module_name}.{p}", values, kw) for p, values, kw in found]
            module_name = module_name.rpartition(".")[0]
        return [(name, tensor, {})] if name in self.params else None

    def load(self, name: str, tensor: torch.Tensor, source: str | None = None) -> list[tuple[str, Index]] | None:
        """Load one checkpoint tensor; returns (parameter, index written) per piece, None if unknown.

        ``source``: the checkpoint's own name, for error messages (default ``name``).
        """
        pieces = self.pieces(name, tensor)
        if pieces is None:
            pieces = self._beside_weight(name, tensor, source or name)
            if pieces == []:
                return []  # a per-tensor value waiting for its module's weight
        if pieces is None or any(p not in self.params for p, _, _ in pieces):
            return None
        written = []
        for param_name, values, kwargs in pieces:
            param = self.params[param_name]
            try:
                index = weight_loader_of(param)(param, values, **kwargs)
            except WeightLoadError as exc:
                raise WeightLoadError(f"checkpoint tensor {source or name} -> {param_name}: {exc}") from None
            self.rows.mark(param_name, param, index)
            written.append((param_name, index))
        self._route(name, pieces)
        return written

    def _route(self, name: str, pieces: list[Piece]) -> None:
        """After a mapped checkpoint weight is written: remember where it went (``_set_routes``)."""
        module, _, attr = name.rpartition(".")
        direct = len(pieces) == 1 and pieces[0][0] == name and not pieces[0][2]
        if attr == "weight" and not direct and module not in self.routes:
            self._set_routes(module, pieces)

    def _set_routes(self, module: str, pieces: list[Piece]) -> None:
        """Where checkpoint module ``module``'s weight goes (its pieces, as weights); load what waited for it."""
        if not all(p.endswith(".weight") for p, _, _ in pieces):
            return
        self.routes[module] = [(p[: -len(".weight")], kw) for p, _, kw in pieces]
        for attr, tensor, source in self.pending.pop(module, []):
            if self.load(f"{module}.{attr}", tensor, source) is None:
                raise WeightLoadError(f"checkpoint tensor {source}: the model has no "
                                      f"{', '.join(f'{t}.{attr}' for t, _ in self.routes[module])}")

    def _beside_weight(self, name: str, tensor: torch.Tensor, source: str) -> list[Piece] | None:
        """Pieces of a tensor stored beside a weight its module maps (see the class docstring); [] when it waits."""
        module, _, attr = name.rpartition(".")
        if not module or attr == "weight" or not self.mappers:
            return None
        if tensor.numel() == 1 and tensor.dim() <= 1:
            routes = self.routes.get(module)
            if routes is None:
                self.pending.setdefault(module, []).append((attr, tensor, source))
                return []
            return [(f"{target}.{attr}", tensor, dict(kw)) for target, kw in routes]
        mapped = self.pieces(f"{module}.weight", tensor)
        if mapped is None or (len(mapped) == 1 and mapped[0][0] == f"{module}.weight" and not mapped[0][2]):
            return None  # no module maps it: a parameter of that name would have been found directly
        if not all(p.endswith(".weight") for p, _, _ in mapped):
            return None
        if module not in self.routes:
            self._set_routes(module, mapped)
        return [(p[: -len("weight")] + attr, values, kw) for p, values, kw in mapped]

    def loaded(self) -> set[str]:
        """Parameters completely written so far; per-tensor values whose weight never came are an error."""
        if self.pending:
            names = sorted(source for waiting in self.pending.values() for _, _, source in waiting)
            raise WeightLoadError(f"checkpoint tensors {', '.join(names[:20])}: per-tensor values of modules whose "
                                  "weight the model does not map")
        return self.rows.complete()


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's quant method bring its loaded weights into the kernel's layout, once.

    Call after ``load_weights`` and before the first forward (and any CUDA-graph capture).
    Calling it again is harmless: each layer is processed once.
    """
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or getattr(module, "_weights_processed", False):
            continue
        with torch.no_grad():
            method.process_weights_after_loading(module)
        module._weights_processed = True
