"""A checkpoint's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) and chat template, via ``tokenizers``.

Loading follows transformers' fast tokenizers: tokens named in ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ``pad_token``, ..., ``additional_special_tokens``) become special
added tokens, ``added_tokens_decoder`` entries missing from ``tokenizer.json`` are added, and
``add_bos_token`` is left to ``tokenizer.json``'s post-processor (transformers ignores the config
flag when ``tokenizer.json`` exists). Chat prompts are encoded with ``add_special_tokens=False``,
as ``apply_chat_template(tokenize=True)`` does: the template writes any BOS itself.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from armillary.chat_template import render_chat_template
from armillary.errors import InvalidRequestError, ModelNotFoundError
from armillary.model_files import load_generation_defaults, resolve_model_path

# transformers' named special tokens; the ones set become chat-template variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or a serialised ``AddedToken``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _extra_special_tokens(config: Mapping[str, Any]) -> list[str]:
    extra: list[str] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key) or []
        items = value.values() if isinstance(value, Mapping) else value
        extra += [c for c in (_token_content(v) for v in items) if c is not None]
    return extra


def _apply_config_tokens(backend: BackendTokenizer, config: Mapping[str, Any]) -> dict[str, str]:
    """Add tokenizer_config.json's added / special tokens to ``backend``; return the named special tokens."""
    declared = config.get("added_tokens_decoder") or {}
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    for _, spec in sorted(declared.items(), key=lambda item: int(item[0])):
        if spec["content"] in known:
            continue
        backend.add_tokens([AddedToken(spec["content"], single_word=spec.get("single_word", False),
                                       lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                                       normalized=spec.get("normalized", not spec.get("special", False)),
                                       special=spec.get("special", False))])

    special_tokens = {name: content for name in SPECIAL_TOKEN_NAMES
                      if (content := _token_content(config.get(name))) is not None}
    added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    for content in dict.fromkeys([*special_tokens.values(), *_extra_special_tokens(config)]):
        # Tokens the config calls special get the special flag (so decode can skip them).
        existing = added.get(content)
        if existing is not None and existing.special:
            continue
        if existing is None:
            token = AddedToken(content, special=True, normalized=False)
        else:
            token = AddedToken(content, single_word=existing.single_word, lstrip=existing.lstrip,
                               rstrip=existing.rstrip, normalized=existing.normalized, special=True)
        backend.add_special_tokens([token])
    return special_tokens


def _load_chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates; separate template files take priority over the config's, as in transformers."""
    templates: dict[str, str] = {}
    if (directory / "chat_template.jinja").is_file():
        templates["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    value = config.get("chat_template")
    if value is None and (directory / "chat_template.json").is_file():
        with open(directory / "chat_template.json", encoding="utf-8") as f:
            value = json.load(f).get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {item["name"]: item["template"] for item in value}
    return {}


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template and end-of-sequence ids."""

    def __init__(self, backend: BackendTokenizer, special_tokens: Mapping[str, str],
                 chat_templates: Mapping[str, str] | None = None,
                 generation_eos_ids: Sequence[int] = (), name_or_path: str = "") -> None:
        self._backend = backend
        self.special_tokens_map: dict[str, str] = dict(special_tokens)
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self._generation_eos_ids = tuple(int(i) for i in generation_eos_ids)
        self.name_or_path = name_or_path

    @classmethod
    def from_pretrained(cls, path: str | Path, revision: str | None = None,
                        cache_dir: str | Path | None = None) -> Tokenizer:
        """Load from a checkpoint directory or a cached Hugging Face repo id (``cache_dir``: the hub cache)."""
        directory = resolve_model_path(path, revision, require_config=False, cache_dir=cache_dir)
        file = directory / "tokenizer.json"
        if not file.is_file():
            present = ", ".join(sorted(p.name for p in directory.iterdir())) or "nothing"
            raise ModelNotFoundError(
                f"no tokenizer.json in {str(directory)!r} (it holds: {present}); armillary needs a "
                "fast-tokenizer file, which transformers can write with save_pretrained")
        backend = BackendTokenizer.from_file(str(file))
        config: dict[str, Any] = {}
        if (directory / "tokenizer_config.json").is_file():
            with open(directory / "tokenizer_config.json", encoding="utf-8") as f:
                config = json.load(f)

        special_tokens = _apply_config_tokens(backend, config)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        eos_ids = load_generation_defaults(directory).get("eos_token_id", [])
        return cls(backend, special_tokens, _load_chat_templates(directory, config), eos_ids, str(directory))

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' ``len(tokenizer)``)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens_map.get(name)
        return None if content is None else self._backend.token_to_id(content)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: generation_config.json's ``eos_token_id`` list, then the tokenizer's eos."""
        ids = list(self._generation_eos_ids)
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return tuple(dict.fromkeys(ids))

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the added tokens flagged special: the ones ``decode(skip_special_tokens=True)`` drops."""
        return sorted(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The default template, if the checkpoint has one."""
        return self.chat_templates.get("default")

    def override_chat_template(self, template: str) -> None:
        """Serve ``template`` (``--chat-template``) for every conversation, with or without tools.

        The checkpoint's other named templates stay selectable by name; its ``tool_use`` template goes,
        since it would otherwise win over the override whenever a request passes tools.
        """
        named = {k: v for k, v in self.chat_templates.items() if k not in ("default", "tool_use")}
        self.chat_templates = {"default": template, **named}

    def get_chat_template(self, tools: Sequence[Mapping[str, Any]] | None = None, name: str | None = None) -> str:
        """The template to render: ``name`` if given, else ``tool_use`` when tools are passed, else ``default``."""
        if name is not None:
            if name not in self.chat_templates:
                raise InvalidRequestError(f"unknown chat template {name!r}; this model has "
                                          f"{sorted(self.chat_templates) or 'none'}")
            return self.chat_templates[name]
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise InvalidRequestError(f"this model has several chat templates and no default: "
                                      f"{sorted(self.chat_templates)}")
        raise InvalidRequestError(f"the model at {self.name_or_path} has no chat template; "
                                  "use the completions API or pass a template")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = True, chat_template: str | None = None,
                            **template_kwargs: Any) -> str:
        """The prompt text for a conversation; encode it with ``add_special_tokens=False``.

        ``chat_template`` is one of the model's template names, or else a template source; ``template_kwargs`` (e.g.
        ``enable_thinking``) become template variables.
        """
        if chat_template is not None and chat_template not in self.chat_templates:
            template = chat_template
        else:
            template = self.get_chat_template(tools, chat_template)
        return render_chat_template(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens_map, **template_kwargs)
