"""Weight-loading speed: a synthetic Qwen3.6-35B-A3B-shaped safetensors checkpoint, read cold, against the disk.

Writes ``--size-gb`` of bf16 tensors (the real model's names and shapes, per-expert tensors as the
hub's checkpoints store them, as many layers as fit the size; random bytes) in 5 GB shards to
``--dir``, evicts them from the page cache (``posix_fadvise DONTNEED`` after ``fsync``, plus
``drop_caches`` where permitted) and checks with ``mincore`` that they are cold before every
read. Then, in one run: the disk's own sequential read speed (O_DIRECT, one ``dd``-like stream
over the first shard and four streams over all of them); armillary's load of the model (the
plugin's ``load_weights`` into device parameters, ``ModelWorker.load_model``); the reader alone
(``iter_safetensors`` to the device), cold and then warm from the page cache; and the loader
before prefetching (``safe_open`` CPU tensors copied in). Phases that would overrun
``--time-budget-s`` are skipped and say so. One line per figure; JSON to ``$OUT/load_speed.json``.

    python bench/load_speed.py --dir /local/nvme/tmp            # on the GPU machine (~30 GB)
    python bench/load_speed.py --tiny                           # CPU smoke test of the driver
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

GB = 1e9
SHARD_BYTES = 5 * 10**9
_EXPERTS = re.compile(r"(?P<pre>.+\.mlp\.experts)\.(?P<which>gate_up_proj|down_proj)$")


def model_config(tiny: bool, layers: int) -> dict:
    from transformers import Qwen3_5MoeTextConfig

    if tiny:
        cfg = Qwen3_5MoeTextConfig(vocab_size=512, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32)
    else:
        cfg = Qwen3_5MoeTextConfig(num_hidden_layers=layers)
    d = cfg.to_dict()
    d["architectures"] = ["Qwen3_5MoeForCausalLM"]
    d["dtype"] = "bfloat16"
    return d


def checkpoint_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the checkpoint, fused experts split per expert as the hub stores them."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    out = []
    for name, t in model.state_dict().items():
        m = _EXPERTS.fullmatch(name)
        if m is None:
            out.append((name, tuple(t.shape)))
            continue
        e, rows, cols = t.shape
        for i in range(e):
            if m["which"] == "gate_up_proj":  # [E, 2I, H]
                out += [(f"{m['pre']}.{i}.gate_proj.weight", (rows // 2, cols)),
                        (f"{m['pre']}.{i}.up_proj.weight", (rows // 2, cols))]
            else:  # [E, H, I]
                out.append((f"{m['pre']}.{i}.down_proj.weight", (rows, cols)))
    return out


def layers_for(size_gb: float, tiny: bool) -> int:
    if tiny:
        return 4
    nbytes = {n: sum(2 * _numel(s) for _, s in checkpoint_tensors(model_config(False, n))) for n in (4, 8)}
    per_layer = (nbytes[8] - nbytes[4]) / 4
    return max(4, round((size_gb * GB - (nbytes[4] - 4 * per_layer)) / per_layer))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def evict(paths: list[Path]) -> None:
    """Out of the page cache: drop_caches where the kernel lets us, and fadvise per file."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def resident_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore); None where it cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    page, resident, total = mmap.PAGESIZE, 0, 0
    for p in paths:
        size = p.stat().st_size
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            pages = (size + page - 1) // page
            vec = ctypes.create_string_buffer(pages)
            ok = libc.mincore(addr, size, vec) == 0
            libc.munmap(addr, size)
            if not ok:
                return None
            resident += sum(b & 1 for b in vec.raw)
            total += pages
        finally:
            os.close(fd)
    return resident / max(1, total)


def write_checkpoint(folder: Path, cfg: dict, tensors: list[tuple[str, tuple[int, ...]]]) -> list[Path]:
    """Shards of at most 5 GB (header + bf16 bytes from a random pool), index and config.json; fsynced."""
    folder.mkdir(parents=True, exist_ok=True)
    pool = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy()
    pool[1::2] &= 0xBF  # the high byte of each bf16: exponent below all-ones, so no NaN or inf (bitwise checks)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        n = 2 * _numel(shape)
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        path = folder / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in shard:
            n = 2 * _numel(shape)
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = path.name
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            left, at = offset, 0
            while left:
                n = min(left, len(pool) - at)
                f.write(memoryview(pool)[at: at + n])
                left -= n
                at = (at + n) % len(pool)
            f.flush()
            os.fsync(f.fileno())
        paths.append(path)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg))
    return paths


def raw_read(paths: list[Path], streams: int, block: int = 64 << 20) -> tuple[float, str]:
    """Bytes per second reading the files sequentially, O_DIRECT (buffered where refused)."""
    jobs = [(p, off) for p in paths for off in range(0, p.stat().st_size, block)]
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    mode = "O_DIRECT"
    try:
        os.close(os.open(paths[0], flags))
    except OSError:
        flags, mode = os.O_RDONLY, "buffered"
    fds = {p: os.open(p, flags) for p in paths}
    buffers = [mmap.mmap(-1, block) for _ in range(streams)]  # page-aligned, as O_DIRECT needs

    def read(k: int) -> int:
        done = 0
        for p, off in jobs[k::streams]:
            done += os.preadv(fds[p], [buffers[k]], off)
        return done

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as ex:
        total = sum(ex.map(read, range(streams)))
    took = time.perf_counter() - start
    for fd in fds.values():
        os.close(fd)
    return total / took, mode


def build_worker(folder: Path, device: torch.device):
    from armillary.config import EngineConfig
    from armillary.kernels import ops
    from armillary.kernels.dispatch import resolve_dispatch
    from armillary.layers.quantization import resolve_quant_config
    from armillary.model_source import open_model_source
    from armillary.registry import default_registry
    from armillary.worker import ModelWorker

    config = EngineConfig(model=str(folder), dtype="bfloat16", device=str(device), max_model_len=4096)
    registry = default_registry()
    source = open_model_source(config.model, None, registry, config)
    hf = source.hf_config()
    arch = registry.resolve_architecture(list(hf.get("architectures")))
    ops.install(resolve_dispatch(registry, arch.name, device, "auto"))
    quant = resolve_quant_config(hf, registry, None)
    return ModelWorker(config, arch.load(), hf, source, device, torch.bfloat16, 4096, quant=quant)


def filesystem_of(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts: the longest matching mount point)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, point, fstype, *_ = line.split()
            if str(path).startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    except OSError:
        pass
    return f"{kind} at {best or '?'}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=30.0)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (a local disk; default: the temp dir)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny checkpoint on the CPU: a smoke test of this driver")
    ap.add_argument("--time-budget-s", type=float, default=270.0)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = ap.parse_args()
    t0 = time.perf_counter()
    device = torch.device("cpu" if args.tiny else args.device)
    base = Path(args.dir or tempfile.gettempdir())
    folder = Path(tempfile.mkdtemp(prefix="armillary-load-", dir=base))
    results: dict = {"device": str(device), "dir": str(folder), "filesystem": filesystem_of(folder.resolve())}
    print(f"checkpoint folder {folder} on {results['filesystem']}", flush=True)
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)

    def figure(key: str, value, line: str) -> None:
        results[key] = value
        print(line, flush=True)

    try:
        cfg = model_config(args.tiny, layers_for(args.size_gb, args.tiny))
        tensors = checkpoint_tensors(cfg)
        start = time.perf_counter()
        paths = write_checkpoint(folder, cfg, tensors)
        nbytes = sum(p.stat().st_size for p in paths)
        took = time.perf_counter() - start
        figure("checkpoint_gb", nbytes / GB, f"checkpoint: {nbytes / GB:.2f} GB, {len(tensors)} tensors, "
               f"{len(paths)} shards, {cfg['num_hidden_layers']} layers; written in {took:.1f} s "
               f"({nbytes / GB / took:.2f} GB/s, fsynced)")
        speed = nbytes / took
        speeds = [speed]  # a phase's time is estimated at the slowest speed seen so far

        def cold(name: str) -> float | None:
            evict(paths)
            frac = resident_fraction(paths)
            results.setdefault("resident_before", {})[name] = frac
            return frac

        def fits(name: str) -> bool:
            eta = nbytes / min(speeds)
            if time.perf_counter() - t0 + eta > args.time_budget_s:
                figure(f"{name}_skipped", True, f"{name}: skipped (~{eta:.0f} s more would pass the time budget)")
                return False
            return True

        def show(frac: float | None) -> str:
            return "page cache unknown" if frac is None else f"{100 * frac:.1f}% in page cache before"

        frac = cold("disk_1_stream")
        one, mode = raw_read(paths[:1], 1)
        speed = one
        speeds = [one]  # reads from here on: estimated at the disk's speed or slower
        figure("disk_1_stream_gbps", one / GB, f"disk, dd-like 1 stream ({mode}, first shard): {one / GB:.2f} GB/s "
               f"({show(frac)})")
        if fits("disk_4_streams"):
            frac = cold("disk_4_streams")
            four, mode = raw_read(paths, 4)
            speed = max(one, four)
            figure("disk_4_streams_gbps", four / GB, f"disk, 4 streams ({mode}, all shards): {four / GB:.2f} GB/s "
                   f"({show(frac)})")
        disk = speed
        results["disk_gbps"] = disk / GB

        from armillary.weights import fill_parameters, iter_safetensors, safetensors_shards

        if fits("armillary_load"):
            worker = build_worker(folder, device)
            frac = cold("armillary_load")
            start = time.perf_counter()
            worker.load_model()
            sync(device)
            took = time.perf_counter() - start
            speed = nbytes / took
            speeds.append(speed)
            figure("armillary_load_gbps", speed / GB, f"armillary load (model, plugin load_weights, to {device}): "
                   f"{took:.1f} s, {speed / GB:.2f} GB/s = {speed / disk:.2f}x the disk ({show(frac)})")
            model = worker.model
            del worker
            snapshot = None
            need = sum(p.numel() * p.element_size() for p in model.parameters())
            if device.type != "cuda" or torch.cuda.mem_get_info(device)[0] > 1.3 * need:
                snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}  # for the exactness check
        if fits("reader_cold"):
            for name in ("reader_cold", "reader_warm"):
                frac = cold(name) if name == "reader_cold" else resident_fraction(paths)
                start = time.perf_counter()
                total = sum(t.numel() * t.element_size() for _, t in iter_safetensors(folder, device=device))
                sync(device)
                took = time.perf_counter() - start
                figure(f"{name}_gbps", total / took / GB, f"armillary reader alone ({name.split('_')[1]}, to {device}): "
                       f"{took:.1f} s, {total / took / GB:.2f} GB/s = {total / took / disk:.2f}x the disk ({show(frac)})")
        if "model" in locals() and fits("safe_open_baseline"):
            from safetensors import safe_open

            def before():
                for shard in safetensors_shards(folder):
                    with safe_open(shard, framework="pt", device="cpu") as f:
                        for name in f.keys():
                            yield name, f.get_tensor(name)

            frac = cold("safe_open_baseline")
            start = time.perf_counter()
            fill_parameters(model, before(), str(folder))
            sync(device)
            took = time.perf_counter() - start
            figure("safe_open_baseline_gbps", nbytes / took / GB, f"loader before prefetching (safe_open, CPU "
                   f"tensors copied in): {took:.1f} s, {nbytes / took / GB:.2f} GB/s = {nbytes / took / disk:.2f}x "
                   f"the disk ({show(frac)})")
            if snapshot is not None:
                differ = [n for n, p in model.named_parameters()
                          if not torch.equal(p.detach().reshape(-1).view(torch.uint8),
                                             snapshot[n].reshape(-1).view(torch.uint8))]
                figure("identical_to_safe_open", not differ, f"exactness: {len(snapshot) - len(differ)}/"
                       f"{len(snapshot)} parameters bitwise equal to the safe_open loader's"
                       + (f"; differ: {differ[:5]}" if differ else ""))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - t0
    print(f"total wall time {results['wall_s']:.0f} s", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "load_speed.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
