"""Where optimizer state lives between steps: on the parameter's device, in host memory, or in one
file per rank. Muon's step reaches its state only through a store.

A store creates state (``new``), takes in loaded state (``adopt``) and walks a list of parameters
with ``each``: it yields each one's state as tensors on the parameter's device, fetches the next
one's meanwhile (a background thread; a side CUDA stream for host memory on GPU) and writes each
back after the caller's body. The state dict (``opt.state``) always holds the stored tensors
themselves (host tensors, or views of the memory-mapped file, wrapped as DTensors for DTensor
parameters), so ``state_dict()`` and DCP read them where they are, without a copy to the device.

Only the fetched tensors are on the device: at most two parameters' state (the one being updated
and the one being fetched), counted in ``peak_window_bytes``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from ..comm.specs import local_shard
from ..processes import start_time

OFFLOAD_PLACES = (None, "cpu", "disk")
MAGIC = b"MUONLAB-OFFLOAD\x01"
HEADER_BYTES = 4096
ALIGN = 64  # slots start on cache-line boundaries
ADAMW_STATE_DTYPE = torch.float32  # AdamW moments are at least fp32 (fp64 for fp64 parameters)


def state_dtype(p: torch.Tensor, key: str, momentum_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a state tensor is kept in: Muon's momentum in ``momentum_dtype`` (None: the
    parameter's dtype, as torch.optim.Muon keeps it), AdamW's moments in fp32, or fp64 for fp64
    parameters (fp32 moments rounded their updates to fp32, and squared gradients past 1e19
    overflowed to an update of zero)."""
    if key == "momentum_buffer":
        return momentum_dtype if momentum_dtype is not None else p.dtype
    return torch.promote_types(p.dtype, ADAMW_STATE_DTYPE)


class OffloadError(OSError):
    """The offload file or directory can't be used (named in the message)."""


def _like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``p`` holds it: a DTensor with p's mesh and placements when p is one, so state
    keys, global shapes and DCP's resharding stay what they are without offload."""
    if not hasattr(p, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class ResidentStore:
    """State on the parameter's device, as without offload: fetch hands out the buffers themselves."""

    place = None

    def __init__(self, momentum_dtype: torch.dtype | None = None):
        self.peak_window_bytes = 0
        self.momentum_dtype = momentum_dtype

    def dtype(self, p: torch.Tensor, key: str) -> torch.dtype:
        return state_dtype(p, key, self.momentum_dtype)

    def new(self, p: torch.Tensor, key: str) -> torch.Tensor:
        return torch.zeros_like(p, dtype=self.dtype(p, key), memory_format=torch.preserve_format)

    def adopt(self, p: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        return value

    def holds(self, local: torch.Tensor) -> bool:
        """Whether ``local`` lives in this store's place away from the device (counted as offloaded)."""
        return False

    def check(self) -> None:
        pass

    def each(self, items, keys, view=None):
        """Yield (tag, [local state tensor per key]) for each (tag, param, state) in ``items``;
        ``view(local tensor)``: the part of it to hand out (a part of a bank), the rest untouched."""
        for tag, _, state in items:
            yield tag, _local_states(state, keys, view)

    def close(self) -> None:
        pass


class _OffloadedStore(ResidentStore):
    """Fetch into fresh tensors on the parameter's device, one parameter ahead, and write back."""

    def __init__(self, momentum_dtype: torch.dtype | None = None):
        super().__init__(momentum_dtype)
        self._pool: ThreadPoolExecutor | None = None
        self._stream = None
        self._window_bytes = 0

    def __getstate__(self):
        # a thread pool or CUDA stream is not state: a copy makes its own when it first steps
        return {k: v for k, v in vars(self).items() if k not in ("_pool", "_stream")}

    def __setstate__(self, d):
        self.__dict__.update(d, _pool=None, _stream=None)

    def _stored(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """The local tensor of p's local shape in this store's place that holds ``key`` (subclasses)."""
        raise NotImplementedError

    def new(self, p, key):
        return _like_param(p, self._stored(p, key).zero_())  # a disk slot may hold a released state

    def adopt(self, p, key, value):
        local = local_shard(value)
        mine = self._stored(p, key)
        if local.shape != mine.shape:
            raise ValueError(f"loaded state {key!r} of shape {tuple(local.shape)} can't be offloaded into a slot "
                             f"of shape {tuple(mine.shape)}")
        if local.data_ptr() != mine.data_ptr():  # DCP may have loaded straight into the stored tensor
            mine.copy_(local)  # in the slot's dtype, as a resident state is cast to its own
        return _like_param(p, mine)

    def _fetch(self, p: torch.Tensor, stored: list[torch.Tensor]):
        """Start copying ``stored`` to p's device; return a function that waits and hands them out."""
        device = local_shard(p).device
        self._window_bytes += sum(t.numel() * t.element_size() for t in stored)
        self.peak_window_bytes = max(self.peak_window_bytes, self._window_bytes)
        if device.type == "cuda":  # guarded: CPU runs never create a stream
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            with torch.cuda.stream(self._stream):
                out = [t.to(device, non_blocking=True) for t in stored]
                done = torch.cuda.Event()
                done.record()

            def ready():
                current = torch.cuda.current_stream(device)
                current.wait_event(done)
                for t in out:  # made on the side stream, used and freed on this one
                    t.record_stream(current)
                return out
            return ready
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="muonlab-offload")
        job = self._pool.submit(lambda: [torch.empty_like(t, device=device).copy_(t) for t in stored])
        return job.result

    def each(self, items, keys, view=None):
        items = list(items)
        self.check()
        pending = None
        for k, (tag, p, state) in enumerate(items):
            stored = _local_states(state, keys, view)  # of a bank in parts, only the part is fetched
            working = (pending or self._fetch(p, stored))()
            # the next parameter's state is read while the caller computes on this one
            pending = self._fetch(items[k + 1][1], _local_states(items[k + 1][2], keys, view)) \
                if k + 1 < len(items) else None
            yield tag, working
            for dst, src in zip(stored, working):
                dst.copy_(src)  # blocking: the device copy is freed right after
            self._window_bytes -= sum(t.numel() * t.element_size() for t in working)


class HostStore(_OffloadedStore):
    """State in host memory (pinned when CUDA is available, for asynchronous copies)."""

    place = "cpu"

    def holds(self, local):
        return local.device.type == "cpu"

    def _stored(self, p, key):
        pin = torch.cuda.is_available()
        return torch.empty(local_shard(p).shape, dtype=self.dtype(p, key), pin_memory=pin)

    def adopt(self, p, key, value):
        local = local_shard(value)
        if local.device.type == "cpu" and local.dtype == self.dtype(p, key) and local.is_contiguous() \
                and (local.is_pinned() or not torch.cuda.is_available()):
            return value  # already where this store keeps state (e.g. DCP loaded into it)
        return super().adopt(p, key, value)


class DiskStore(_OffloadedStore):
    """State in ONE memory-mapped file per rank, ``<dir>/muonlab_state_rank<r>.bin``.

    The file starts with a header (magic, a token of this run, a JSON manifest of the slots) and
    is checked (size, inode, header) before each step reads it: a file truncated or replaced
    between steps raises OffloadError instead of a SIGBUS or silently wrong state. A lock file
    with the owner's pid keeps two live runs out of one directory.
    """

    place = "disk"

    def __init__(self, offload_dir, rank: int, slots: list[tuple[torch.Tensor, str]], names: dict,
                 momentum_dtype: torch.dtype | None = None):
        super().__init__(momentum_dtype)
        if offload_dir is None:
            raise ValueError('state_offload="disk" needs offload_dir (a directory for one state file per rank)')
        self.dir = os.path.abspath(os.fspath(offload_dir))
        self.path = os.path.join(self.dir, f"muonlab_state_rank{rank}.bin")
        self.lock_path = os.path.join(self.dir, f"muonlab_state_rank{rank}.lock")
        self._names = names
        self._slots: dict[tuple[int, str], tuple[int, tuple[int, ...], torch.dtype]] = {}
        self._layout(slots)
        self._prepare_dir()
        self._token = os.urandom(16)
        self._take_lock()
        try:
            self._create()
        except BaseException:
            self._release_lock()
            raise
        self._finalizer = weakref.finalize(self, DiskStore._cleanup, self.lock_path, self.path)

    # ------------------------------------------------------------ the layout and the file

    def _layout(self, slots) -> None:
        offset = HEADER_BYTES
        self._manifest = []
        for p, key in slots:
            shape, dtype = tuple(local_shard(p).shape), self.dtype(p, key)
            nbytes = local_shard(p).numel() * dtype.itemsize
            self._slots[(id(p), key)] = (offset, shape, dtype)
            self._manifest.append(dict(name=self._names.get(p, "?"), key=key, offset=offset, shape=list(shape),
                                       dtype=str(dtype)))
            offset += -(-nbytes // ALIGN) * ALIGN
        self.size = offset

    def _prepare_dir(self) -> None:
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise OffloadError(e.errno, f"offload_dir {self.dir!r} can't be created: {e.strerror}") from None
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise OffloadError(errno.EACCES, f"offload_dir {self.dir!r} is not writable")
        free = shutil.disk_usage(self.dir).free
        have = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        if free + have < self.size:
            raise OffloadError(errno.ENOSPC, f"offload_dir {self.dir!r} has {free} bytes free, the optimizer "
                                             f"state file {self.path!r} needs {self.size}")

    def _take_lock(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = _lock_owner(self.lock_path)
                if owner is not None and _held_by_a_live_run(owner, self.lock_path):
                    # in a notebook the other one is often an earlier optimizer of this very process
                    mine = " (this process: drop the earlier optimizer first)" if owner[0] == os.getpid() else ""
                    raise OffloadError(errno.EBUSY, f"offload_dir {self.dir!r} is in use by another live run "
                                                    f"(pid {owner[0]}{mine}, lock {self.lock_path!r})") from None
                os.unlink(self.lock_path)  # stale: its owner is gone
                continue
            except OSError as e:
                raise OffloadError(e.errno, f"offload_dir {self.dir!r} is not writable ({e.strerror})") from None
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {start_time(os.getpid())}")
            _HELD_LOCKS.add(os.path.realpath(self.lock_path))
            return
        raise OffloadError(errno.EBUSY, f"could not take the lock {self.lock_path!r}")

    def _release_lock(self) -> None:
        DiskStore._cleanup(self.lock_path, None)

    @staticmethod
    def _cleanup(lock_path: str, path: str | None) -> None:
        owner = _lock_owner(lock_path)
        if owner is not None and owner[0] == os.getpid() and os.path.realpath(lock_path) in _HELD_LOCKS:
            os.unlink(lock_path)
        _HELD_LOCKS.discard(os.path.realpath(lock_path))

    def _header(self) -> bytes:
        manifest = json.dumps(dict(size=self.size, slots=self._manifest)).encode()
        head = MAGIC + self._token + len(manifest).to_bytes(8, "little")
        # the manifest is for people and tools reading the file; the check compares the fixed part
        return (head + manifest)[:HEADER_BYTES].ljust(HEADER_BYTES, b"\0")

    def _create(self) -> None:
        # a new file, never the old one truncated: an earlier optimizer's state_dict() holds views of
        # the old file's mapping, and they must keep their values
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with open(self.path, "wb") as f:
            # zeros: every slot starts as fresh state. The blocks are claimed now (a sparse file
            # claims them at the mapping's first write, and a full disk then kills the process
            # with SIGBUS: the free-space check above reserves nothing, another run may take it)
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(f.fileno(), 0, self.size)
                else:
                    f.truncate(self.size)
            except OSError as e:
                f.close()
                os.unlink(self.path)
                raise OffloadError(e.errno, f"offload_dir {self.dir!r} can't hold the optimizer state file "
                                            f"{self.path!r} ({self.size} bytes): {e.strerror}") from None
            f.seek(0)
            f.write(self._header())
        self._inode = os.stat(self.path).st_ino
        self._map = torch.from_file(self.path, shared=True, size=self.size, dtype=torch.uint8)

    def check(self) -> None:
        """OffloadError unless the file is the one this run wrote, whole (before any read)."""
        try:
            st = os.stat(self.path)
            with open(self.path, "rb") as f:
                head = f.read(len(MAGIC) + len(self._token))
        except OSError as e:
            raise OffloadError(e.errno, f"optimizer state file {self.path!r} can't be read: {e.strerror}") from None
        if st.st_size != self.size:
            raise OffloadError(errno.EIO, f"optimizer state file {self.path!r} has {st.st_size} bytes, expected "
                                          f"{self.size}: it was truncated or changed since the last step")
        if st.st_ino != self._inode or head != MAGIC + self._token:
            raise OffloadError(errno.EIO, f"optimizer state file {self.path!r} was replaced or its header "
                                          "changed since the last step")

    def holds(self, local):
        start = self._map.data_ptr()
        return start <= local.data_ptr() < start + self.size

    def _stored(self, p, key):
        offset, shape, dtype = self._slots[(id(p), key)]
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        return self._map[offset:offset + nbytes].view(dtype).view(shape)

    def __getstate__(self):
        raise TypeError(f'a Muon with state_offload="disk" can\'t be copied or pickled: its state lives in '
                        f"{self.path!r}, locked by this run; save a checkpoint (muonlab.checkpoint) instead")

    def close(self) -> None:
        """Release the lock (the file stays until the directory is removed)."""
        self._finalizer()


_HELD_LOCKS: set[str] = set()
"""Lock files (real paths) that this process's live DiskStores hold: a lock naming this process's
pid but not listed here was left by an earlier process of the same pid (a restarted container's
run is pid 1 again)."""


def _lock_owner(lock_path: str) -> tuple[int, str] | None:
    """(pid, start time) written in a lock file (start time "" in locks of older versions)."""
    try:
        with open(lock_path) as f:
            pid, _, start = f.read().strip().partition(" ")
            return int(pid or -1), start
    except (OSError, ValueError):
        return None


def _held_by_a_live_run(owner: tuple[int, str], lock_path: str) -> bool:
    pid, start = owner
    if pid == os.getpid():
        return os.path.realpath(lock_path) in _HELD_LOCKS
    if not _alive(pid):
        return False
    now = start_time(pid)
    return not (start and now) or start == now  # unknown start times: the pid alone decides


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


class StateStores:
    """Which store holds which state key: everything in one place, or (with
    ``keep_muon_momentum_in_memory``) Muon momentum resident and AdamW moments offloaded."""

    def __init__(self, place, offload_dir, keep_muon_momentum_in_memory: bool, params, names: dict, rank: int,
                 momentum_dtype: torch.dtype | None = None):
        if place not in OFFLOAD_PLACES:
            raise ValueError(f"unknown state_offload {place!r}; choose one of {OFFLOAD_PLACES}")
        if not isinstance(keep_muon_momentum_in_memory, bool):
            raise TypeError(f"keep_muon_momentum_in_memory must be a bool, got {keep_muon_momentum_in_memory!r}")
        if place != "disk" and offload_dir is not None:
            raise ValueError(f'offload_dir is only used with state_offload="disk", got state_offload={place!r}')
        if place is None and keep_muon_momentum_in_memory:
            raise ValueError('keep_muon_momentum_in_memory=True needs state_offload ("cpu" or "disk"): without '
                             'it all state is already in memory on the parameters\' device')
        self.place = place
        resident = ResidentStore(momentum_dtype)
        momentum_away = place is not None and not keep_muon_momentum_in_memory
        if place == "disk":
            keys = [(p, k) for p, algorithm in params for k in _keys(algorithm)
                    if momentum_away or algorithm == "adamw"]
            offloaded = DiskStore(offload_dir, rank, keys, names, momentum_dtype)
        else:
            offloaded = HostStore(momentum_dtype) if place == "cpu" else resident
        self.by_key = {"momentum_buffer": offloaded if momentum_away else resident,
                       "exp_avg": offloaded, "exp_avg_sq": offloaded}

    def stores(self) -> list:
        return list({id(s): s for s in self.by_key.values()}.values())

    def new(self, p, key):
        return self.by_key[key].new(p, key)

    def dtype(self, p, key) -> torch.dtype:
        return self.by_key[key].dtype(p, key)

    def place_of(self, key: str):
        """None where ``key`` stays on the parameters' device, else "cpu" or "disk"."""
        return self.by_key[key].place

    def adopt(self, p, key, value):
        return self.by_key[key].adopt(p, key, value) if key in self.by_key else value

    def check(self) -> None:
        for s in self.stores():
            s.check()

    def each(self, items, keys, view=None):
        store = self.by_key[keys[0]]
        assert all(self.by_key[k] is store for k in keys), "one walk reads one store"
        return store.each(items, keys, view)

    def peak_window_bytes(self) -> int:
        return sum(s.peak_window_bytes for s in self.stores() if s.place is not None)

    def close(self) -> None:
        for s in self.stores():
            s.close()


def _local_states(state: dict, keys, view) -> list[torch.Tensor]:
    """The local shards of ``state``'s tensors under ``keys``, each through ``view`` if given."""
    local = [local_shard(state[k]) for k in keys]
    return local if view is None else [view(t) for t in local]


def _keys(algorithm: str) -> tuple[str, ...]:
    return ("momentum_buffer",) if algorithm == "muon" else ("exp_avg", "exp_avg_sq")
