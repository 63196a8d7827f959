"""Slower tiers for the prefix cache: KV blocks evicted from the cache pool live on in host
RAM and then on disk, and come back into free pool blocks when a new prompt starts with them.

  BlockManager evicts a cached block  -> PrefixStore.block_evicted  -> top tier .put
  RamTier over its budget             -> its least recently used block -> next tier .put
  BlockManager misses a prefix block  -> PrefixStore.restore_block  -> copy into the pool block

On a CPU the pool already lives in RAM, so the chain is just [DiskTier]; with the pool on a
GPU it is [RamTier, DiskTier]. A block is named by the block manager's hash chain (the hash of
every token up to the end of the block), so one key names one whole prefix.

A disk block is one file `<hash hex>.kvb`: b"KTKV", a u32 header length, a JSON header
(format version, model id, block size, token ids, dtype and shape of each tensor, payload
size and blake2b checksum) and the raw tensor bytes. Files are written to a temporary name
and renamed, so a crash never leaves half a block under a real name. The index is rebuilt
at start by reading every header; a file from another model, format or layout, or one
that fails its checksum, is deleted and never loaded.
"""

import hashlib
import io
import json
import math
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..errors import KtError
from .forward_batch import KVCache

FORMAT_VERSION = 1
MAGIC = b"KTKV"
SUFFIX = ".kvb"
_HEADER_LEN = struct.Struct("<I")


class PrefixStoreError(KtError):
    pass


@dataclass(frozen=True)
class BlockLayout:
    """What one block holds: one tensor per (layer, cached tensor), each [block_size, *token_shape]."""
    model_id: str
    block_size: int
    tensors: tuple[tuple[str, tuple[int, ...]], ...]   # (dtype name, shape) in layer order

    @classmethod
    def of_cache(cls, kv: KVCache, model_id: str) -> "BlockLayout":
        tensors = tuple((str(t.dtype).removeprefix("torch."), (kv.block_size, *t.shape[1:]))
                        for layer in kv.layers for t in layer)
        return cls(model_id, kv.block_size, tensors)

    @property
    def block_bytes(self) -> int:
        return sum(math.prod(shape) * _itemsize(dtype) for dtype, shape in self.tensors)


@dataclass
class StoredBlock:
    token_ids: tuple[int, ...]
    tensors: list[torch.Tensor]   # on the CPU, as BlockLayout.tensors describes

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class Tier(Protocol):
    name: str

    def has(self, key: bytes) -> bool: ...

    def get(self, key: bytes) -> StoredBlock | None: ...

    def put(self, key: bytes, block: StoredBlock) -> None: ...


@dataclass
class TierStats:
    stored: int = 0
    loaded: int = 0
    dropped: int = 0
    rejected: int = 0
    bytes_used: int = 0
    blocks: int = 0


class RamTier:
    """Host-memory LRU; what it must let go of goes to `lower` (or is dropped)."""
    name = "ram"

    def __init__(self, capacity_bytes: int, lower: Tier | None = None):
        self.capacity_bytes, self.lower = capacity_bytes, lower
        self.blocks: OrderedDict[bytes, StoredBlock] = OrderedDict()
        self.stats = TierStats()

    def has(self, key: bytes) -> bool:
        return key in self.blocks

    def get(self, key: bytes) -> StoredBlock | None:
        block = self.blocks.get(key)
        if block is not None:
            self.blocks.move_to_end(key)
            self.stats.loaded += 1
        return block

    def put(self, key: bytes, block: StoredBlock) -> None:
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return
        if block.nbytes > self.capacity_bytes:
            self._pass_down(key, block)
            return
        self.blocks[key] = block
        self.stats.stored += 1
        self.stats.bytes_used += block.nbytes
        while self.stats.bytes_used > self.capacity_bytes:
            old_key, old = self.blocks.popitem(last=False)
            self.stats.bytes_used -= old.nbytes
            self._pass_down(old_key, old)
        self.stats.blocks = len(self.blocks)

    def _pass_down(self, key: bytes, block: StoredBlock) -> None:
        if self.lower is not None:
            self.lower.put(key, block)
        else:
            self.stats.dropped += 1


class DiskTier:
    """One file per block in `directory`, at most capacity_bytes in all, least recently used
    evicted first (file mtimes carry the order across restarts)."""
    name = "disk"

    def __init__(self, directory: Path, capacity_bytes: int, layout: BlockLayout):
        self.directory, self.capacity_bytes, self.layout = Path(directory), capacity_bytes, layout
        self.directory.mkdir(parents=True, exist_ok=True)
        self.index: OrderedDict[bytes, int] = OrderedDict()   # key -> file size
        self.stats = TierStats()
        self._last_stamp = 0
        self._rebuild_index()

    def has(self, key: bytes) -> bool:
        return key in self.index

    def get(self, key: bytes) -> StoredBlock | None:
        if key not in self.index:
            return None
        block = self._read(self._path(key))
        if block is None:
            self._forget(key)
            self.stats.rejected += 1
            return None
        self.index.move_to_end(key)
        self._touch(self._path(key))
        self.stats.loaded += 1
        return block

    def put(self, key: bytes, block: StoredBlock) -> None:
        if key in self.index:
            self.index.move_to_end(key)
            return
        data = encode_block(self.layout, key, block)
        if len(data) > self.capacity_bytes:
            self.stats.dropped += 1
            return
        self._make_room(len(data))
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self._touch(path)
        self._remember(key, len(data))
        self.stats.stored += 1

    def sync(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _touch(self, path: Path) -> None:
        """Strictly increasing mtimes: the LRU order survives a restart even when the file
        system's clock is coarser than our writes."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        os.utime(path, ns=(self._last_stamp, self._last_stamp))

    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}{SUFFIX}"

    def _make_room(self, nbytes: int) -> None:
        while self.index and self.stats.bytes_used + nbytes > self.capacity_bytes:
            key = next(iter(self.index))
            self._forget(key)
            self.stats.dropped += 1

    def _remember(self, key: bytes, size: int) -> None:
        self.index[key] = size
        self.stats.bytes_used += size
        self.stats.blocks = len(self.index)

    def _forget(self, key: bytes) -> None:
        self.stats.bytes_used -= self.index.pop(key)
        self.stats.blocks = len(self.index)
        self._path(key).unlink(missing_ok=True)

    def _rebuild_index(self) -> None:
        for stale in self.directory.glob("*.tmp*"):
            stale.unlink(missing_ok=True)
        found = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            size = self._valid_size(path) if _is_hex(path.stem) else None
            if size is None:
                path.unlink(missing_ok=True)
                self.stats.rejected += 1
            else:
                found.append((path.stat().st_mtime_ns, bytes.fromhex(path.stem), size))
        for stamp, key, size in sorted(found):
            self._remember(key, size)
            self._last_stamp = max(self._last_stamp, stamp)
        self._make_room(0)

    def _valid_size(self, path: Path) -> int | None:
        """File size when its header names this layout and this key, else None."""
        try:
            with path.open("rb") as f:
                header, offset = read_header(f)
            size = path.stat().st_size
        except (OSError, ValueError):
            return None
        if not header_matches(header, self.layout, path.stem) or size != offset + header["payload_bytes"]:
            return None
        return size

    def _read(self, path: Path) -> StoredBlock | None:
        try:
            data = path.read_bytes()
            return decode_block(self.layout, path.stem, data)
        except (OSError, ValueError):
            return None


class PrefixStore:
    """The block manager's eviction listener and prefix source, over a chain of tiers."""

    def __init__(self, tiers: list[Tier]):
        if not tiers:
            raise PrefixStoreError("a prefix store needs at least one tier")
        self.tiers = tiers
        self.kv: KVCache | None = None

    @classmethod
    def for_cache(cls, kv: KVCache, model_id: str, disk_dir: Path | None, disk_bytes: int,
                  ram_bytes: int = 0) -> "PrefixStore":
        """RAM tier only when the pool is off the host (GPU); disk tier when a directory is given."""
        layout = BlockLayout.of_cache(kv, model_id)
        disk = DiskTier(disk_dir, disk_bytes, layout) if disk_dir is not None else None
        pool_on_host = kv.layers[0][0].device.type == "cpu"
        ram = RamTier(ram_bytes, disk) if ram_bytes > 0 and not pool_on_host else None
        store = cls([tier for tier in (ram, disk) if tier is not None])
        store.kv = kv
        return store

    def install(self, engine) -> None:
        """Hook this store under an LLMEngine's block pool."""
        self.kv = engine.runner.kv
        engine.block_manager.eviction_listener = self
        engine.block_manager.prefix_source = self

    def block_evicted(self, block_hash: bytes, token_ids: tuple[int, ...], block_id: int) -> None:
        self.tiers[0].put(block_hash, StoredBlock(tuple(token_ids), read_block(self._cache(), block_id)))

    def has_block(self, block_hash: bytes) -> bool:
        return any(tier.has(block_hash) for tier in self.tiers)

    def restore_block(self, block_hash: bytes, token_ids: tuple[int, ...], block_id: int) -> bool:
        for tier in self.tiers:
            block = tier.get(block_hash)
            if block is not None and block.token_ids == tuple(token_ids):
                write_block(self._cache(), block_id, block)
                return True
        return False

    def persist(self, block_manager) -> int:
        """Copy every block the pool still caches down to the last tier (at shutdown); returns
        how many were written."""
        last, written = self.tiers[-1], 0
        for block in block_manager.blocks:
            if block.hash is not None and not last.has(block.hash):
                last.put(block.hash, StoredBlock(block.token_ids, read_block(self._cache(), block.block_id)))
                written += 1
        if isinstance(last, DiskTier):
            last.sync()
        return written

    def stats(self) -> dict[str, TierStats]:
        return {tier.name: tier.stats for tier in self.tiers}

    def _cache(self) -> KVCache:
        if self.kv is None:
            raise PrefixStoreError("prefix store used before it was attached to a KV cache")
        return self.kv


def read_block(kv: KVCache, block_id: int) -> list[torch.Tensor]:
    rows = slice(block_id * kv.block_size, (block_id + 1) * kv.block_size)
    return [t[rows].to("cpu", copy=True) for layer in kv.layers for t in layer]


def write_block(kv: KVCache, block_id: int, block: StoredBlock) -> None:
    rows = slice(block_id * kv.block_size, (block_id + 1) * kv.block_size)
    cache_tensors = [t for layer in kv.layers for t in layer]
    for dst, src in zip(cache_tensors, block.tensors, strict=True):
        dst[rows].copy_(src)


def encode_block(layout: BlockLayout, key: bytes, block: StoredBlock) -> bytes:
    payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in block.tensors)
    header = dict(format=FORMAT_VERSION, model=layout.model_id, block_size=layout.block_size,
                  key=key.hex(), tokens=list(block.token_ids),
                  tensors=[[dtype, list(shape)] for dtype, shape in layout.tensors],
                  payload_bytes=len(payload), checksum=hashlib.blake2b(payload, digest_size=16).hexdigest())
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _HEADER_LEN.pack(len(encoded)) + encoded + payload


def read_header(f) -> tuple[dict, int]:
    """-> (header dict, payload offset); ValueError when the bytes are not a block header."""
    lead = f.read(len(MAGIC) + _HEADER_LEN.size)
    if len(lead) != len(MAGIC) + _HEADER_LEN.size or lead[:len(MAGIC)] != MAGIC:
        raise ValueError("not a kt KV block file")
    (length,) = _HEADER_LEN.unpack(lead[len(MAGIC):])
    if length > 1 << 24:
        raise ValueError("header too long")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"bad header: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("bad header")
    return header, len(lead) + length


def header_matches(header: dict, layout: BlockLayout, key_hex: str) -> bool:
    tensors = header.get("tensors")
    return (header.get("format") == FORMAT_VERSION and header.get("model") == layout.model_id
            and header.get("block_size") == layout.block_size and header.get("key") == key_hex
            and isinstance(tensors, list)
            and [(d, tuple(s)) for d, s in tensors] == list(layout.tensors)
            and isinstance(header.get("payload_bytes"), int)
            and header["payload_bytes"] == layout.block_bytes
            and isinstance(header.get("tokens"), list) and len(header["tokens"]) == layout.block_size)


def decode_block(layout: BlockLayout, key_hex: str, data: bytes) -> StoredBlock:
    header, offset = read_header(io.BytesIO(data))
    if not header_matches(header, layout, key_hex):
        raise ValueError("block file does not match this model's KV layout")
    payload = data[offset:]
    if len(payload) != header["payload_bytes"] or \
            hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("checksum"):
        raise ValueError("block file fails its checksum")
    return StoredBlock(tuple(int(t) for t in header["tokens"]), _split_payload(layout, payload))


def _split_payload(layout: BlockLayout, payload: bytes) -> list[torch.Tensor]:
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    tensors, start = [], 0
    for dtype, shape in layout.tensors:
        size = math.prod(shape) * _itemsize(dtype)
        tensors.append(raw[start:start + size].view(getattr(torch, dtype)).reshape(shape))
        start += size
    return tensors


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return bool(text)
