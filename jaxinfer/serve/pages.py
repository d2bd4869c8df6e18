"""Host-side page bookkeeping: which pages are free, who holds each one, and the prefix cache.

Pure Python, no device: the engine's scheduler asks this allocator for page numbers and the
device only ever sees page tables.

A page is in exactly one of four states:
  free       on the free list, owned by nobody;
  held       refcount >= 1: in the page table of that many requests;
  cached     refcount 0 but still in the prefix cache, waiting to be shared again or evicted
             (least recently used first) when a new page is needed;
  to scrub   refcount 0, poisoned: a request that held it failed for non-finite values, so it
             may hold inf or NaN, which a later owner's attention would read as 0 x NaN = NaN at
             positions it masks. It returns to the free list once the device has zeroed it
             (`take_to_scrub`, then `scrubbed`).

Prefix cache: a full page of prompt tokens is keyed by a hash of the whole token prefix up to
the end of that page (`prefix_hashes`), so equal keys mean equal attention context and equal
keys/values. A request whose prompt starts with cached pages takes them (refcount + 1, no
copy) and prefills only the rest.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

from jaxinfer.model.cache import TRASH_PAGE


def prefix_hashes(tokens: Sequence[int], page_size: int, n_pages: int, salt: bytes = b"") -> list[bytes]:
    """Keys of the first n_pages full pages of `tokens`: key i hashes tokens[: (i + 1) * page_size]
    (chained: sha256 of the previous key and page i's tokens). `salt` starts the chain: requests
    whose keys/values differ for the same tokens (steered ones) get keys of their own."""
    out, h = [], salt
    for i in range(n_pages):
        page = np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64)
        if len(page) < page_size:
            raise ValueError(f"page {i} is not full ({len(page)} of {page_size} tokens)")
        h = hashlib.sha256(h + page.tobytes()).digest()
        out.append(h)
    return out


class OutOfPages(RuntimeError):
    """Raised by `PagePool.allocate` when neither free nor evictable pages are left."""


class PagePool:
    """Page allocator with reference counts and an LRU prefix cache.

    Pages 1 .. n_pages - 1 are allocatable (page 0 is the device's trash page).
    """

    def __init__(self, n_pages: int, page_size: int):
        if n_pages < 2:
            raise ValueError(f"n_pages must be >= 2 (page 0 is the trash page), got {n_pages}")
        self.n_pages, self.page_size = n_pages, page_size
        self.refcount = [0] * n_pages
        self._free = collections.deque(p for p in range(n_pages) if p != TRASH_PAGE)
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._poisoned: set[int] = set()  # held pages that go to `_to_scrub` when released
        self._to_scrub: list[int] = []  # unreferenced poisoned pages, not yet zeroed on the device
        self.hit_pages = 0  # pages taken from the prefix cache
        self.evictions = 0

    # ---- counts -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Allocatable pages (all but the trash page)."""
        return self.n_pages - 1

    @property
    def in_use(self) -> int:
        """Pages held by at least one request."""
        return self.capacity - len(self._free) - len(self._evictable) - len(self._to_scrub)

    @property
    def cached(self) -> int:
        """Unreferenced pages kept for the prefix cache (evictable)."""
        return len(self._evictable)

    def available(self) -> int:
        """Pages an allocation can get now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    # ---- allocation ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n fresh pages (refcount 1), evicting least recently used cached pages if needed."""
        if n > self.available():
            raise OutOfPages(f"need {n} pages, {self.available()} available")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(page)]
                self.evictions += 1
            self.refcount[page] = 1
            out.append(page)
        return out

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; an unreferenced page is cached (if registered) or freed."""
        for page in pages:
            if self.refcount[page] <= 0:
                raise ValueError(f"page {page} released but not held")
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                if page in self._poisoned:
                    self._poisoned.discard(page)
                    self._to_scrub.append(page)
                elif page in self._hash_of:
                    self._evictable[page] = None  # most recently used at the end
                else:
                    self._free.append(page)

    # ---- pages that may hold non-finite values -------------------------------------------------
    def poison(self, pages: Sequence[int]) -> None:
        """These held pages may hold inf or NaN: they leave the prefix cache now (no request takes
        them again) and, once released by every holder, wait to be scrubbed instead of freed."""
        for page in pages:
            if self.refcount[page] <= 0:
                raise ValueError(f"page {page} poisoned but not held")
            h = self._hash_of.pop(page, None)
            if h is not None:
                del self._by_hash[h]
            self._poisoned.add(page)

    def scrub_wanted(self) -> bool:
        """Some unreferenced poisoned pages wait to be zeroed (`take_to_scrub`)."""
        return bool(self._to_scrub)

    def take_to_scrub(self) -> list[int]:
        """The unreferenced poisoned pages, to be zeroed on the device (then `scrubbed`)."""
        return list(self._to_scrub)

    def scrubbed(self, pages: Sequence[int]) -> None:
        """These pages (from `take_to_scrub`) are zeroed on the device: they are free again."""
        for page in pages:
            self._to_scrub.remove(page)
            self._free.append(page)

    # ---- prefix cache -------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Cached pages for the longest prefix of `hashes` (no references taken)."""
        out = []
        for h in hashes:
            page = self._by_hash.get(h)
            if page is None:
                break
            out.append(page)
        return out

    def acquire(self, pages: Sequence[int]) -> None:
        """Take a reference to cached pages returned by `match`."""
        for page in pages:
            if self.refcount[page] == 0:
                del self._evictable[page]
            self.refcount[page] += 1
            self.hit_pages += 1

    def register(self, h: bytes, page: int) -> None:
        """Offer a held, full page of prompt tokens to the prefix cache under key h.

        If h is already cached (the same prefix computed twice), the existing page stays the
        cached one and this page remains private (freed when released).
        """
        if self.refcount[page] <= 0:
            raise ValueError(f"page {page} is not held")
        if h in self._by_hash or page in self._hash_of:
            return
        self._by_hash[h], self._hash_of[page] = page, h

    def forget(self) -> None:
        """Empty the prefix cache (the pages' contents are gone, e.g. after the device pool was
        rebuilt): cached pages and pages waiting to be scrubbed become free (a new pool holds
        zeros), held pages stay held but are no longer shared or poisoned."""
        for page in list(self._evictable) + self._to_scrub:
            self._free.append(page)
        self._evictable.clear()
        self._to_scrub.clear()
        self._poisoned.clear()
        self._by_hash.clear()
        self._hash_of.clear()

    # ---- invariants ---------------------------------------------------------------------------
    def check(self, held: Sequence[Sequence[int]]) -> None:
        """Assert the pool's invariants given every request's page list (for tests).

        Each allocatable page is in exactly one state; refcounts equal the number of page lists
        holding the page; no request holds a page twice.
        """
        counts = collections.Counter()
        for pages in held:
            assert len(set(pages)) == len(pages), f"a request holds a page twice: {pages}"
            counts.update(pages)
        free, evictable, scrub = set(self._free), set(self._evictable), set(self._to_scrub)
        assert len(free) == len(self._free) and len(scrub) == len(self._to_scrub)
        assert not (free & evictable) and not (scrub & (free | evictable))
        assert TRASH_PAGE not in free | evictable | scrub
        assert all(self.refcount[p] > 0 for p in self._poisoned) and not (self._poisoned & set(self._hash_of))
        for page in range(self.n_pages):
            if page == TRASH_PAGE:
                assert counts[page] == 0
                continue
            assert self.refcount[page] == counts[page], f"page {page}: refcount {self.refcount[page]} != {counts[page]}"
            states = (page in free) + (page in evictable) + (page in scrub) + (self.refcount[page] > 0)
            assert states == 1, f"page {page} is in {states} states"
            if page in evictable:
                assert page in self._hash_of
        assert all(self._by_hash[h] == p for p, h in self._hash_of.items())
