/*
 * dynamod.shared.kv._kvcore: the compiled core of the router's KV index and block hashing.
 *
 * Why C: the router applies every worker's KV events (a fleet emits well over a million block
 * events per second) and matches every prompt against an index of millions of blocks. In pure
 * Python each block costs several dict operations and an xxh3 call through the interpreter,
 * about 2 us; here it is a few cache misses. The semantics are exactly those of the pure-Python
 * index (shared/kv/index_python.py), which stays as the fallback and the reference: the same
 * model-based tests run against both.
 *
 * Layout (kept flat so a million blocks cost no Python objects and no GC work):
 *   - nodes[]: one record per distinct block (prefix) in the tree: its sequence hash (identity),
 *     its local tokens hash, parent / first child / sibling links (0 = none; node 0 is the root),
 *     and how many holders hold it;
 *   - masks[]: W 64-bit words per node, bit h set when holder h holds the node; W grows with the
 *     number of holders (more than 64 workers is ordinary);
 *   - nodemap: sequence hash -> node (open addressing, linear probing, backward-shift deletion);
 *   - per holder: by_hash (engine hash -> node), hash_of (node -> its first engine hash), extra
 *     (node -> further engine hashes, a chain in a shared pool; rare), and its block count.
 * A holder is an opaque Python key chosen by the caller (today a (worker_id, dp_rank) pair); a
 * per-tier index registers one holder per (worker, rank, tier) without any change here.
 *
 * Invariants (checked by check()): a holder's held set is prefix-closed, so along a prompt the
 * holder masks only shrink; an engine hash names one held block; nodes nobody holds are unlinked
 * and freed at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash.h"

#define KV_HASH_SEED 1337ULL
#define ROOT 0u
#define NIL 0u

/* ------------------------------------------------------------------------------------------ */
/* Hashing. */

static inline void store_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline uint64_t chain(uint64_t parent, uint64_t local) {
    unsigned char buf[16];
    store_le64(buf, parent);
    store_le64(buf + 8, local);
    return XXH3_64bits_withSeed(buf, 16, KV_HASH_SEED);
}

/* A Python int as u64 (hashes are u64; other ints are taken modulo 2**64). -1 with an error set
 * on a non-int. */
static inline int as_u64(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "expected an int hash, got %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = PyLong_AsUnsignedLongLongMask(o);
    if (*out == (uint64_t)-1 && PyErr_Occurred()) return -1;
    return 0;
}

/* ``p`` reallocated to ``n`` items of ``size`` bytes; NULL with MemoryError set (``p`` still
 * valid) when that fails. How every growing array here grows. */
static void *grow(void *p, size_t n, size_t size) {
    void *q = PyMem_Realloc(p, n * size);
    if (q == NULL) PyErr_NoMemory();
    return q;
}

/* The attribute ``name`` of ``o`` as u64 (``as_u64``); -1 with an error set. */
static inline int attr_u64(PyObject *o, PyObject *name, uint64_t *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    int rc = as_u64(v, out);
    Py_DECREF(v);
    return rc;
}

/* A token id from an exact int: small ints (every real token id) read directly from the object,
 * which is most of the cost of hashing a long prompt; anything else through the C API. */
static inline unsigned long compact_token(PyObject *t) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)t)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)t);
        if (v >= 0) return (unsigned long)v;
    }
#else
    Py_ssize_t size = Py_SIZE(t);
    if (size == 0) return 0;
    if (size == 1) return (unsigned long)((PyLongObject *)t)->ob_digit[0];
#endif
    return PyLong_AsUnsignedLong(t);
}

static PyObject *py_block_hashes(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t block_size;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OnK", &tokens, &block_size, &seed)) return NULL;
    if (block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", block_size);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(tokens, "tokens must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_ssize_t nblocks = n / block_size;
    PyObject *out = PyList_New(nblocks);
    if (out == NULL || nblocks == 0) {
        Py_DECREF(fast);
        return out;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    size_t step = (size_t)block_size * 4;
    unsigned char *buf = PyMem_Malloc(step);
    if (buf == NULL) {
        Py_DECREF(fast);
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        PyObject **blk = items + b * block_size;
        for (Py_ssize_t i = 0; i < block_size; i++) {
            PyObject *t = blk[i];
            unsigned long v;
            if (PyLong_CheckExact(t)) {
                v = compact_token(t);
            } else { /* numpy integers and other __index__ types, as array("I", ...) takes them */
                PyObject *as_int = PyNumber_Index(t);
                if (as_int == NULL) goto fail;
                v = PyLong_AsUnsignedLong(as_int);
                Py_DECREF(as_int);
            }
            if (v == (unsigned long)-1 && PyErr_Occurred()) goto fail;
            if (v > 0xFFFFFFFFUL) {
                PyErr_SetString(PyExc_OverflowError, "token id is greater than the maximum u32");
                goto fail;
            }
            unsigned char *p = buf + 4 * i;
            p[0] = (unsigned char)v;
            p[1] = (unsigned char)(v >> 8);
            p[2] = (unsigned char)(v >> 16);
            p[3] = (unsigned char)(v >> 24);
        }
        PyObject *h = PyLong_FromUnsignedLongLong(XXH3_64bits_withSeed(buf, step, (XXH64_hash_t)seed));
        if (h == NULL) goto fail;
        PyList_SET_ITEM(out, b, h);
    }
    PyMem_Free(buf);
    Py_DECREF(fast);
    return out;
fail:
    PyMem_Free(buf);
    Py_DECREF(fast);
    Py_DECREF(out);
    return NULL;
}

static PyObject *py_sequence_hashes(PyObject *self, PyObject *args) {
    PyObject *locals, *parent_obj = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &locals, &parent_obj)) return NULL;
    PyObject *fast = PySequence_Fast(locals, "local hashes must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyList_New(n);
    if (out == NULL) goto fail0;
    uint64_t prev = 0;
    int have_parent = parent_obj != Py_None;
    if (have_parent && as_u64(parent_obj, &prev) < 0) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t local;
        if (as_u64(items[i], &local) < 0) goto fail;
        prev = (i == 0 && !have_parent) ? local : chain(prev, local);
        PyObject *h = PyLong_FromUnsignedLongLong(prev);
        if (h == NULL) goto fail;
        PyList_SET_ITEM(out, i, h);
    }
    Py_DECREF(fast);
    return out;
fail:
    Py_DECREF(out);
fail0:
    Py_DECREF(fast);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
#include "u64map.h"

/* ------------------------------------------------------------------------------------------ */
/* The index. */

typedef struct {
    uint64_t seq; /* sequence hash: the node's identity */
    uint64_t key; /* the block's local tokens hash */
    uint32_t parent, first_child, next, prev;
    uint32_t nholders; /* 0 only for the root and for free nodes */
    uint32_t _pad;
} Node;

typedef struct {
    int used;
    Map by_hash; /* engine hash -> node */
    Map hash_of; /* node -> its first engine hash */
    Map extra; /* node -> pool index of its further engine hashes (rare) */
    int64_t size; /* blocks held */
    int64_t synced; /* size last written to the sizes dict */
} Holder;

typedef struct {
    PyObject_HEAD
    Node *nodes;
    uint64_t *masks; /* W words per node */
    uint32_t ncap, nused, free_node, W;
    uint64_t nlive; /* nodes in the tree, the root excluded */
    Map nodemap;
    Holder *holders;
    uint32_t hcap;
    int64_t total;
    uint64_t collisions; /* engine hashes reused for another block (KvStored), ever */
    /* pool of extra engine-hash names: chains linked by xnext, 0 = end */
    uint64_t *xext;
    uint32_t *xnext;
    uint32_t xcap, xused, xfree;
    /* scratch list of node ids (drop, clear, dump) */
    uint32_t *scratch;
    size_t scap;
    PyObject *keys; /* list: holder -> its key object (None when free) */
    PyObject *sizes; /* dict: key -> blocks held, for every registered holder */
} Index;

static inline uint64_t *mask_of(Index *ix, uint32_t node) { return ix->masks + (size_t)node * ix->W; }

static inline int is_held(Index *ix, uint32_t node, uint32_t h) {
    return (int)((ix->masks[(size_t)node * ix->W + (h >> 6)] >> (h & 63)) & 1u);
}

static int masks_equal(Index *ix, uint32_t a, uint32_t b) {
    if (a == b) return 1;
    if (a == NIL || b == NIL) return 0; /* the root (0) stands for "not found": holds nothing */
    if (ix->nodes[a].nholders != ix->nodes[b].nholders) return 0;
    return memcmp(mask_of(ix, a), mask_of(ix, b), ix->W * sizeof(uint64_t)) == 0;
}

static int scratch_reserve(Index *ix, size_t n) {
    if (n <= ix->scap) return 0;
    size_t cap = ix->scap ? ix->scap : 256;
    while (cap < n) cap *= 2;
    uint32_t *p = grow(ix->scratch, cap, sizeof(uint32_t));
    if (p == NULL) return -1;
    ix->scratch = p;
    ix->scap = cap;
    return 0;
}

static int nodes_grow(Index *ix) {
    uint32_t cap = ix->ncap * 2;
    if (cap <= ix->ncap) {
        PyErr_SetString(PyExc_MemoryError, "kv index: too many blocks");
        return -1;
    }
    Node *n = grow(ix->nodes, cap, sizeof(Node));
    if (n == NULL) return -1;
    ix->nodes = n;
    uint64_t *m = grow(ix->masks, (size_t)cap * ix->W, sizeof(uint64_t));
    if (m == NULL) return -1;
    ix->masks = m;
    ix->ncap = cap;
    return 0;
}

/* Widens every node's mask to hold holder bit h. */
static int masks_widen(Index *ix, uint32_t h) {
    uint32_t W = ix->W;
    while ((W << 6) <= h) W *= 2;
    if (W == ix->W) return 0;
    uint64_t *m = PyMem_Calloc((size_t)ix->ncap * W, sizeof(uint64_t));
    if (m == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < ix->nused; i++) memcpy(m + (size_t)i * W, ix->masks + (size_t)i * ix->W, ix->W * sizeof(uint64_t));
    PyMem_Free(ix->masks);
    ix->masks = m;
    ix->W = W;
    return 0;
}

static uint32_t node_alloc(Index *ix) {
    uint32_t id;
    if (ix->free_node != NIL) {
        id = ix->free_node;
        ix->free_node = ix->nodes[id].next;
    } else {
        if (ix->nused == ix->ncap && nodes_grow(ix) < 0) return NIL;
        id = ix->nused++;
    }
    memset(mask_of(ix, id), 0, ix->W * sizeof(uint64_t));
    return id;
}

static void node_free(Index *ix, uint32_t id) {
    ix->nodes[id].nholders = 0;
    ix->nodes[id].next = ix->free_node;
    ix->free_node = id;
}

static void unlink_node(Index *ix, uint32_t s) {
    Node *n = &ix->nodes[s];
    if (n->prev == NIL)
        ix->nodes[n->parent].first_child = n->next;
    else
        ix->nodes[n->prev].next = n->next;
    if (n->next != NIL) ix->nodes[n->next].prev = n->prev;
}

/* Unlinks and frees nodes nobody holds. `dead` is closed under descendants, so only the nodes
 * whose parent survives are unlinked; the rest go with them. */
static void delete_dead(Index *ix, uint32_t *dead, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t s = dead[i];
        uint32_t p = ix->nodes[s].parent;
        if (p == ROOT || ix->nodes[p].nholders > 0) unlink_node(ix, s);
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t s = dead[i];
        map_del(&ix->nodemap, ix->nodes[s].seq, NULL);
        node_free(ix, s);
    }
    ix->nlive -= n;
}

static int sync_size(Index *ix, uint32_t h) {
    Holder *H = &ix->holders[h];
    if (H->size == H->synced) return 0;
    PyObject *v = PyLong_FromLongLong(H->size);
    if (v == NULL) return -1;
    int rc = PyDict_SetItem(ix->sizes, PyList_GET_ITEM(ix->keys, h), v);
    Py_DECREF(v);
    if (rc == 0) H->synced = H->size;
    return rc;
}

static inline void add_size(Index *ix, uint32_t h, int64_t n) {
    ix->holders[h].size += n;
    ix->total += n;
}

static void extra_free_chain(Index *ix, uint32_t x, Map *by_hash) {
    while (x) {
        uint32_t nx = ix->xnext[x];
        if (by_hash) map_del(by_hash, ix->xext[x], NULL);
        ix->xnext[x] = ix->xfree;
        ix->xfree = x;
        x = nx;
    }
}

static int extra_add(Index *ix, uint32_t h, uint32_t node, uint64_t ext) {
    Holder *H = &ix->holders[h];
    uint64_t head = 0;
    map_get(&H->extra, node, &head);
    uint32_t last = 0;
    for (uint32_t x = (uint32_t)head; x; x = ix->xnext[x]) {
        if (ix->xext[x] == ext) return 0;
        last = x;
    }
    uint32_t x;
    if (ix->xfree) {
        x = ix->xfree;
        ix->xfree = ix->xnext[x];
    } else {
        if (ix->xused >= ix->xcap) {
            uint32_t cap = ix->xcap ? ix->xcap * 2 : 64;
            uint64_t *e = grow(ix->xext, cap, sizeof(uint64_t));
            if (e == NULL) return -1;
            ix->xext = e;
            uint32_t *nx = grow(ix->xnext, cap, sizeof(uint32_t));
            if (nx == NULL) return -1;
            ix->xnext = nx;
            ix->xcap = cap;
        }
        x = ix->xused++;
    }
    ix->xext[x] = ext;
    ix->xnext[x] = 0;
    if (last)
        ix->xnext[last] = x; /* keep the order names arrived in */
    else if (map_put(&H->extra, node, x) < 0)
        return -1;
    return 0;
}

/* Appends the holder's held children of `node` to the scratch list at *n. */
static int push_held_children(Index *ix, uint32_t node, uint32_t h, size_t *n) {
    for (uint32_t c = ix->nodes[node].first_child; c != NIL; c = ix->nodes[c].next) {
        if (!is_held(ix, c, h)) continue;
        if (scratch_reserve(ix, *n + 1) < 0) return -1;
        ix->scratch[(*n)++] = c;
    }
    return 0;
}

/* Removes `top` and the holder's blocks below it, with all their names. */
static int drop(Index *ix, uint32_t h, uint32_t top) {
    Holder *H = &ix->holders[h];
    if (scratch_reserve(ix, 1) < 0) return -1;
    size_t n = 0;
    ix->scratch[n++] = top;
    for (size_t i = 0; i < n; i++) /* breadth-first: parents before children */
        if (push_held_children(ix, ix->scratch[i], h, &n) < 0) return -1;
    uint32_t *sub = ix->scratch;
    uint64_t word_clear = ~((uint64_t)1 << (h & 63));
    size_t ndead = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t s = sub[i];
        uint64_t ext;
        if (map_del(&H->hash_of, s, &ext)) map_del(&H->by_hash, ext, NULL);
        if (H->extra.count) {
            uint64_t head;
            if (map_del(&H->extra, s, &head)) extra_free_chain(ix, (uint32_t)head, &H->by_hash);
        }
        mask_of(ix, s)[h >> 6] &= word_clear;
        if (--ix->nodes[s].nholders == 0) sub[ndead++] = s; /* compacts in place */
    }
    delete_dead(ix, sub, ndead);
    add_size(ix, h, -(int64_t)n);
    return 0;
}

/* One block of a KvStored chain under *parentp (see store()). 0: go on; 1: stop (the chain's
 * own prefix was dropped by a hash collision); -1: error. */
static inline int store_one(Index *ix, uint32_t h, uint32_t *parentp, uint64_t ext, uint64_t key, uint64_t s,
                            int64_t *added) {
    Holder *H = &ix->holders[h];
    uint32_t parent = *parentp;
    uint64_t v;
    uint32_t node = map_get(&ix->nodemap, s, &v) ? (uint32_t)v : NIL;
    int name = 1;
    if (map_get(&H->by_hash, ext, &v)) {
        if ((uint32_t)v == node) {
            name = 0;
        } else { /* the hash already names another block: drop that block, then name this one */
            ix->collisions++;
            if (*added) {
                add_size(ix, h, *added);
                *added = 0;
            }
            if (drop(ix, h, (uint32_t)v) < 0) return -1;
            if (parent != ROOT && !is_held(ix, parent, h)) return 1;
            node = map_get(&ix->nodemap, s, &v) ? (uint32_t)v : NIL;
        }
    }
    uint64_t word_bit = (uint64_t)1 << (h & 63);
    if (node == NIL) {
        node = node_alloc(ix);
        if (node == NIL) return -1;
        Node *n = &ix->nodes[node];
        n->seq = s;
        n->key = key;
        n->parent = parent;
        n->prev = NIL;
        n->first_child = NIL;
        n->nholders = 1;
        Node *p = &ix->nodes[parent];
        n->next = p->first_child;
        if (p->first_child != NIL) ix->nodes[p->first_child].prev = node;
        p->first_child = node;
        mask_of(ix, node)[h >> 6] |= word_bit;
        ix->nlive++;
        if (map_put(&ix->nodemap, s, node) < 0 || map_put(&H->hash_of, node, ext) < 0) return -1;
        (*added)++;
    } else if (!(mask_of(ix, node)[h >> 6] & word_bit)) {
        mask_of(ix, node)[h >> 6] |= word_bit;
        ix->nodes[node].nholders++;
        if (map_put(&H->hash_of, node, ext) < 0) return -1;
        (*added)++;
    } else {
        uint64_t first = 0;
        map_get(&H->hash_of, node, &first);
        if (first != ext && extra_add(ix, h, node, ext) < 0) return -1;
    }
    if (name && map_put(&H->by_hash, ext, node) < 0) return -1;
    *parentp = node;
    return 0;
}

static int check_holder(Index *ix, Py_ssize_t h) {
    if (h < 0 || (size_t)h >= ix->hcap || !ix->holders[h].used) {
        PyErr_Format(PyExc_KeyError, "no holder %zd", h);
        return -1;
    }
    return 0;
}

static PyObject *str_block_hash, *str_tokens_hash;

/* store(holder, parent_hash | None, blocks) -> True when applied, False when the parent is not
 * held (the event is dropped). `blocks`: objects with block_hash and tokens_hash (StoredBlock). */
static PyObject *Index_store(Index *ix, PyObject *args) {
    Py_ssize_t h;
    PyObject *parent_obj, *blocks;
    if (!PyArg_ParseTuple(args, "nOO", &h, &parent_obj, &blocks)) return NULL;
    if (check_holder(ix, h) < 0) return NULL;
    uint32_t parent = ROOT;
    if (parent_obj != Py_None) {
        uint64_t ph, v;
        if (as_u64(parent_obj, &ph) < 0) return NULL;
        if (!map_get(&ix->holders[h].by_hash, ph, &v)) Py_RETURN_FALSE;
        parent = (uint32_t)v;
    }
    PyObject *fast = PySequence_Fast(blocks, "blocks must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int64_t added = 0;
    int rc = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t ext, key;
        rc = attr_u64(items[i], str_block_hash, &ext);
        if (rc < 0) break;
        rc = attr_u64(items[i], str_tokens_hash, &key);
        if (rc < 0) break;
        uint64_t s = parent == ROOT ? key : chain(ix->nodes[parent].seq, key);
        rc = store_one(ix, (uint32_t)h, &parent, ext, key, s, &added);
        if (rc != 0) break;
    }
    Py_DECREF(fast);
    if (added > 0) add_size(ix, (uint32_t)h, added);
    if (sync_size(ix, (uint32_t)h) < 0 || rc < 0) return NULL;
    Py_RETURN_TRUE;
}

/* store_chain(holder, exts, keys, seqs): a chain from the root, sequence hashes precomputed. */
static PyObject *Index_store_chain(Index *ix, PyObject *args) {
    Py_ssize_t h;
    PyObject *exts, *keys, *seqs;
    if (!PyArg_ParseTuple(args, "nOOO", &h, &exts, &keys, &seqs)) return NULL;
    if (check_holder(ix, h) < 0) return NULL;
    PyObject *fe = PySequence_Fast(exts, "block hashes must be a sequence");
    PyObject *fk = fe ? PySequence_Fast(keys, "tokens hashes must be a sequence") : NULL;
    PyObject *fs = fk ? PySequence_Fast(seqs, "sequence hashes must be a sequence") : NULL;
    int rc = -1;
    int64_t added = 0;
    if (fs == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fe);
    if (PySequence_Fast_GET_SIZE(fk) != n || PySequence_Fast_GET_SIZE(fs) != n) {
        PyErr_SetString(PyExc_ValueError, "store_chain: block, tokens and sequence hashes differ in length");
        goto done;
    }
    uint32_t parent = ROOT;
    rc = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t ext, key, s;
        if (as_u64(PySequence_Fast_GET_ITEM(fe, i), &ext) < 0 || as_u64(PySequence_Fast_GET_ITEM(fk, i), &key) < 0 ||
            as_u64(PySequence_Fast_GET_ITEM(fs, i), &s) < 0) {
            rc = -1;
            break;
        }
        rc = store_one(ix, (uint32_t)h, &parent, ext, key, s, &added);
        if (rc != 0) break;
    }
    if (added > 0) add_size(ix, (uint32_t)h, added);
    if (sync_size(ix, (uint32_t)h) < 0) rc = -1;
done:
    Py_XDECREF(fe);
    Py_XDECREF(fk);
    Py_XDECREF(fs);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* remove(holder, engine hashes) -> blocks the holder no longer holds. */
static PyObject *Index_remove(Index *ix, PyObject *args) {
    Py_ssize_t h;
    PyObject *hashes;
    if (!PyArg_ParseTuple(args, "nO", &h, &hashes)) return NULL;
    if (check_holder(ix, h) < 0) return NULL;
    PyObject *fast = PySequence_Fast(hashes, "block hashes must be a sequence");
    if (fast == NULL) return NULL;
    Holder *H = &ix->holders[h];
    int64_t before = H->size;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t word_clear = ~((uint64_t)1 << (h & 63));
    int rc = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t ext, v;
        if (as_u64(items[i], &ext) < 0) {
            rc = -1;
            break;
        }
        if (!map_get(&H->by_hash, ext, &v)) continue;
        uint32_t s = (uint32_t)v;
        uint32_t c = ix->nodes[s].first_child;
        while (c != NIL && !is_held(ix, c, (uint32_t)h)) c = ix->nodes[c].next;
        if (c != NIL || H->extra.count) { /* held descendants or several names: the general case */
            if (drop(ix, (uint32_t)h, s) < 0) {
                rc = -1;
                break;
            }
            continue;
        }
        uint64_t first;
        if (map_del(&H->hash_of, s, &first)) map_del(&H->by_hash, first, NULL);
        add_size(ix, (uint32_t)h, -1);
        mask_of(ix, s)[h >> 6] &= word_clear;
        if (--ix->nodes[s].nholders) continue;
        unlink_node(ix, s); /* nobody holds the leaf any more */
        map_del(&ix->nodemap, ix->nodes[s].seq, NULL);
        node_free(ix, s);
        ix->nlive--;
    }
    Py_DECREF(fast);
    if (sync_size(ix, (uint32_t)h) < 0 || rc < 0) return NULL;
    return PyLong_FromLongLong(before - H->size);
}

static int clear_holder(Index *ix, uint32_t h) {
    Holder *H = &ix->holders[h];
    if (scratch_reserve(ix, map_len(&H->hash_of) + 1) < 0) return -1;
    uint64_t word_clear = ~((uint64_t)1 << (h & 63));
    size_t ndead = 0;
    for (uint64_t i = 0; i <= H->hash_of.mask; i++) {
        uint32_t s = (uint32_t)H->hash_of.slots[i].key;
        if (s == NIL) continue;
        mask_of(ix, s)[h >> 6] &= word_clear;
        if (--ix->nodes[s].nholders == 0) ix->scratch[ndead++] = s;
    }
    delete_dead(ix, ix->scratch, ndead);
    for (uint64_t i = 0; i <= H->extra.mask; i++)
        if (H->extra.slots[i].key) extra_free_chain(ix, (uint32_t)H->extra.slots[i].val, NULL);
    if (map_reset(&H->by_hash) < 0 || map_reset(&H->hash_of) < 0 || map_reset(&H->extra) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    add_size(ix, h, -H->size);
    return sync_size(ix, h);
}

static PyObject *Index_clear(Index *ix, PyObject *args) {
    Py_ssize_t h;
    if (!PyArg_ParseTuple(args, "n", &h)) return NULL;
    if (check_holder(ix, h) < 0 || clear_holder(ix, (uint32_t)h) < 0) return NULL;
    Py_RETURN_NONE;
}

/* register(key) -> holder number (its bit in the masks). */
static PyObject *Index_register(Index *ix, PyObject *key) {
    uint32_t h = 0;
    while (h < ix->hcap && ix->holders[h].used) h++;
    if (h == ix->hcap) {
        uint32_t cap = ix->hcap ? ix->hcap * 2 : 64;
        Holder *p = grow(ix->holders, cap, sizeof(Holder));
        if (p == NULL) return NULL;
        memset(p + ix->hcap, 0, (size_t)(cap - ix->hcap) * sizeof(Holder));
        ix->holders = p;
        ix->hcap = cap;
    }
    if (masks_widen(ix, h) < 0) return NULL;
    Holder *H = &ix->holders[h];
    if (map_init(&H->by_hash, 4) < 0 || map_init(&H->hash_of, 4) < 0 || map_init(&H->extra, 4) < 0) return PyErr_NoMemory();
    while ((Py_ssize_t)h >= PyList_GET_SIZE(ix->keys))
        if (PyList_Append(ix->keys, Py_None) < 0) return NULL;
    Py_INCREF(key);
    PyList_SetItem(ix->keys, h, key);
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL || PyDict_SetItem(ix->sizes, key, zero) < 0) {
        Py_XDECREF(zero);
        return NULL;
    }
    Py_DECREF(zero);
    H->used = 1;
    H->size = H->synced = 0;
    return PyLong_FromUnsignedLong(h);
}

/* unregister(holder): forgets it (its blocks first), freeing its number for reuse. */
static PyObject *Index_unregister(Index *ix, PyObject *args) {
    Py_ssize_t h;
    if (!PyArg_ParseTuple(args, "n", &h)) return NULL;
    if (check_holder(ix, h) < 0 || clear_holder(ix, (uint32_t)h) < 0) return NULL;
    Holder *H = &ix->holders[h];
    map_free(&H->by_hash);
    map_free(&H->hash_of);
    map_free(&H->extra);
    H->used = 0;
    PyObject *key = PyList_GET_ITEM(ix->keys, h);
    if (PyDict_DelItem(ix->sizes, key) < 0) PyErr_Clear();
    Py_INCREF(Py_None);
    PyList_SetItem(ix->keys, h, Py_None);
    Py_RETURN_NONE;
}

/* Adds `depth` for every holder in mask(a) & ~mask(b) (b may be NIL: nothing held). */
static int score_dropped(Index *ix, PyObject *scores, uint32_t a, uint32_t b, Py_ssize_t depth) {
    PyObject *d = PyLong_FromSsize_t(depth);
    if (d == NULL) return -1;
    uint64_t *ma = mask_of(ix, a);
    uint64_t *mb = b == NIL ? NULL : mask_of(ix, b);
    int rc = 0;
    for (uint32_t w = 0; w < ix->W && rc == 0; w++) {
        uint64_t bits = ma[w] & (mb ? ~mb[w] : ~(uint64_t)0);
        while (bits) {
            uint32_t h = (w << 6) | (uint32_t)__builtin_ctzll(bits);
            bits &= bits - 1;
            if (PyDict_SetItem(scores, PyList_GET_ITEM(ix->keys, h), d) < 0) {
                rc = -1;
                break;
            }
        }
    }
    Py_DECREF(d);
    return rc;
}

static inline uint32_t find_node(Index *ix, uint64_t s) {
    uint64_t v;
    return map_get(&ix->nodemap, s, &v) ? (uint32_t)v : NIL;
}

#define MATCH_WINDOW 32

static inline void prefetch_slot(const Map *m, uint64_t k) { __builtin_prefetch(&m->slots[map_home(m, k)]); }

/* Scores a prompt given its sequence hashes. Masks only shrink along a prompt (held sets are
 * prefix-closed), so equal masks at both ends of a window of blocks mean no change inside: one
 * lookup covers the window. A window where holders drop out is scanned block by block, its
 * lookups issued together (prefetched) so their cache misses overlap instead of queueing: a
 * staircase where 64 workers drop out at 64 depths costs about what a full hit does. */
static int match_core(Index *ix, const uint64_t *seqs, Py_ssize_t n, PyObject *scores) {
    if (n == 0) return 0;
    uint32_t cur = find_node(ix, seqs[0]);
    if (cur == NIL) return 0;
    for (Py_ssize_t e = MATCH_WINDOW; e < n; e += MATCH_WINDOW) prefetch_slot(&ix->nodemap, seqs[e]);
    prefetch_slot(&ix->nodemap, seqs[n - 1]);
    uint32_t ids[MATCH_WINDOW];
    Py_ssize_t i = 0; /* every holder in cur holds seqs[: i + 1] */
    while (i < n - 1) {
        Py_ssize_t end = i + MATCH_WINDOW < n - 1 ? i + MATCH_WINDOW : n - 1;
        if (masks_equal(ix, find_node(ix, seqs[end]), cur)) {
            i = end;
            continue;
        }
        Py_ssize_t w = end - i;
        for (Py_ssize_t k = 0; k < w; k++) prefetch_slot(&ix->nodemap, seqs[i + 1 + k]);
        for (Py_ssize_t k = 0; k < w; k++) {
            uint32_t id = ids[k] = find_node(ix, seqs[i + 1 + k]);
            if (id == NIL) {
                w = k + 1; /* nobody holds it: nothing beyond matters */
                break;
            }
            __builtin_prefetch(&ix->nodes[id]);
            __builtin_prefetch(mask_of(ix, id));
        }
        for (Py_ssize_t k = 0; k < w; k++) {
            uint32_t node = ids[k];
            if (masks_equal(ix, node, cur)) continue;
            /* the mask changes between i + k and i + k + 1: those holders hold i + k + 1 blocks */
            if (score_dropped(ix, scores, cur, node, i + k + 1) < 0) return -1;
            cur = node;
            if (cur == NIL) return 0;
        }
        i = end;
    }
    return score_dropped(ix, scores, cur, NIL, n);
}

/* The prompt's sequence hashes in a C array: from local hashes (hashing the chain, a few ns per
 * block here) or as given. */
static uint64_t *prompt_hashes(PyObject *fast, int chained, uint64_t *stackbuf, Py_ssize_t cap) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t *buf = n <= cap ? stackbuf : PyMem_Malloc((size_t)n * sizeof(uint64_t));
    if (buf == NULL) return (uint64_t *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h;
        if (as_u64(items[i], &h) < 0) {
            if (buf != stackbuf) PyMem_Free(buf);
            return NULL;
        }
        buf[i] = (chained && i) ? chain(buf[i - 1], h) : h;
    }
    return buf;
}

static PyObject *match(Index *ix, PyObject *hashes, int chained) {
    uint64_t stackbuf[512];
    PyObject *fast = PySequence_Fast(hashes, "hashes must be a sequence");
    if (fast == NULL) return NULL;
    PyObject *scores = PyDict_New();
    uint64_t *seqs = scores ? prompt_hashes(fast, chained, stackbuf, 512) : NULL;
    if (seqs == NULL || match_core(ix, seqs, PySequence_Fast_GET_SIZE(fast), scores) < 0) Py_CLEAR(scores);
    if (seqs != NULL && seqs != stackbuf) PyMem_Free(seqs);
    Py_DECREF(fast);
    return scores;
}

/* match_local(local hashes) -> {key: leading blocks held} */
static PyObject *Index_match_local(Index *ix, PyObject *locals) { return match(ix, locals, 1); }

/* match_seq(sequence hashes) -> {key: leading blocks held} */
static PyObject *Index_match_seq(Index *ix, PyObject *seqs) { return match(ix, seqs, 0); }

/* The (holder, engine hash) arguments of ``holds`` and ``node_hash``; -1 with an error set. */
static int holder_ext_args(Index *ix, PyObject *args, Py_ssize_t *h, uint64_t *ext) {
    PyObject *ext_obj;
    if (!PyArg_ParseTuple(args, "nO", h, &ext_obj)) return -1;
    if (check_holder(ix, *h) < 0) return -1;
    return as_u64(ext_obj, ext);
}

static PyObject *Index_holds(Index *ix, PyObject *args) {
    Py_ssize_t h;
    uint64_t ext, v;
    if (holder_ext_args(ix, args, &h, &ext) < 0) return NULL;
    return PyBool_FromLong(map_get(&ix->holders[h].by_hash, ext, &v));
}

/* node_hash(holder, engine hash) -> the sequence hash of the block that name stands for, or None.
 * A lower-tier store (shared/kv/index_tiers.py) may continue a chain whose parent the worker
 * holds only on its device: this finds where that chain is in the tree. */
static PyObject *Index_node_hash(Index *ix, PyObject *args) {
    Py_ssize_t h;
    uint64_t ext, v;
    if (holder_ext_args(ix, args, &h, &ext) < 0) return NULL;
    if (!map_get(&ix->holders[h].by_hash, ext, &v)) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(ix->nodes[(uint32_t)v].seq);
}

static PyObject *ext_or_none(Index *ix, uint32_t h, uint32_t node) {
    uint64_t ext = 0;
    if (node == ROOT) Py_RETURN_NONE;
    map_get(&ix->holders[h].hash_of, node, &ext);
    return PyLong_FromUnsignedLongLong(ext);
}

/* dump(holder) -> (chains, extras): chains [(parent engine hash | None, [(engine hash, tokens
 * hash), ...]), ...] parents before children, then every further name as (parent | None,
 * engine hash, tokens hash). Replaying them rebuilds the same held blocks and names. */
static PyObject *Index_dump(Index *ix, PyObject *args) {
    Py_ssize_t h;
    if (!PyArg_ParseTuple(args, "n", &h)) return NULL;
    if (check_holder(ix, h) < 0) return NULL;
    Holder *H = &ix->holders[h];
    PyObject *chains = PyList_New(0), *extras = PyList_New(0), *chain_list = NULL;
    if (chains == NULL || extras == NULL) goto fail;
    size_t n = 0;
    if (push_held_children(ix, ROOT, (uint32_t)h, &n) < 0) goto fail;
    uint32_t last = ROOT; /* no chain open while chain_list is NULL */
    while (n) { /* depth-first, so a chain continues while it descends */
        uint32_t s = ix->scratch[--n];
        uint32_t parent = ix->nodes[s].parent;
        if (chain_list == NULL || parent != last) {
            PyObject *p = ext_or_none(ix, (uint32_t)h, parent);
            chain_list = PyList_New(0);
            PyObject *t = (p && chain_list) ? PyTuple_Pack(2, p, chain_list) : NULL;
            Py_XDECREF(p);
            Py_XDECREF(chain_list); /* borrowed from here on: the tuple holds it */
            if (t == NULL || PyList_Append(chains, t) < 0) {
                Py_XDECREF(t);
                goto fail;
            }
            Py_DECREF(t);
        }
        uint64_t ext = 0;
        map_get(&H->hash_of, s, &ext);
        PyObject *b = Py_BuildValue("(KK)", (unsigned long long)ext, (unsigned long long)ix->nodes[s].key);
        if (b == NULL || PyList_Append(chain_list, b) < 0) {
            Py_XDECREF(b);
            goto fail;
        }
        Py_DECREF(b);
        last = s;
        if (push_held_children(ix, s, (uint32_t)h, &n) < 0) goto fail;
    }
    for (uint64_t i = 0; i <= H->extra.mask; i++) {
        uint32_t s = (uint32_t)H->extra.slots[i].key;
        if (s == NIL) continue;
        for (uint32_t x = (uint32_t)H->extra.slots[i].val; x; x = ix->xnext[x]) {
            PyObject *p = ext_or_none(ix, (uint32_t)h, ix->nodes[s].parent);
            if (p == NULL) goto fail;
            PyObject *t = Py_BuildValue("(OKK)", p, (unsigned long long)ix->xext[x], (unsigned long long)ix->nodes[s].key);
            Py_DECREF(p);
            if (t == NULL || PyList_Append(extras, t) < 0) {
                Py_XDECREF(t);
                goto fail;
            }
            Py_DECREF(t);
        }
    }
    PyObject *res = PyTuple_Pack(2, chains, extras);
    Py_DECREF(chains);
    Py_DECREF(extras);
    return res;
fail:
    Py_XDECREF(chains);
    Py_XDECREF(extras);
    return NULL;
}

#define CHECK(cond, msg)                                        \
    do {                                                        \
        if (!(cond)) {                                          \
            PyErr_SetString(PyExc_AssertionError, "kv index: " msg); \
            goto fail;                                          \
        }                                                       \
    } while (0)

/* check(): asserts the structure is consistent (tests and debugging; walks everything). */
static PyObject *Index_check(Index *ix, PyObject *unused) {
    uint64_t seen = 0;
    uint32_t W = ix->W;
    uint64_t *stack = NULL;
    size_t top = 0, cap = 0;
    int64_t total = 0;
    uint64_t v;
    /* depth-first over the links from the root */
    cap = 64;
    stack = PyMem_Malloc(cap * sizeof(uint64_t));
    if (stack == NULL) return PyErr_NoMemory();
    stack[top++] = ROOT;
    while (top) {
        uint32_t node = (uint32_t)stack[--top];
        uint32_t prev = NIL;
        for (uint32_t c = ix->nodes[node].first_child; c != NIL; c = ix->nodes[c].next) {
            CHECK(c < ix->nused, "link to a node out of range");
            Node *cn = &ix->nodes[c];
            CHECK(cn->parent == node && cn->prev == prev, "broken parent or sibling link");
            CHECK(cn->nholders > 0, "an unheld node is still linked");
            uint32_t count = 0;
            for (uint32_t w = 0; w < W; w++) {
                count += (uint32_t)__builtin_popcountll(mask_of(ix, c)[w]);
                if (node != ROOT) CHECK((mask_of(ix, c)[w] & ~mask_of(ix, node)[w]) == 0, "a child held where its parent is not");
            }
            CHECK(count == cn->nholders, "holder count differs from the mask");
            CHECK(map_get(&ix->nodemap, cn->seq, &v) && v == c, "node missing from the hash map");
            CHECK(node == ROOT ? cn->seq == cn->key : cn->seq == chain(ix->nodes[node].seq, cn->key), "sequence hash is not the chain");
            seen++;
            CHECK(seen <= ix->nlive, "a node linked twice");
            if (top == cap) {
                uint64_t *p = grow(stack, 2 * cap, sizeof(uint64_t));
                if (p == NULL) {
                    PyMem_Free(stack);
                    return NULL;
                }
                stack = p;
                cap *= 2;
            }
            stack[top++] = c;
            prev = c;
        }
    }
    CHECK(seen == ix->nlive && map_len(&ix->nodemap) == ix->nlive, "node count mismatch");
    for (uint32_t h = 0; h < ix->hcap; h++) {
        Holder *H = &ix->holders[h];
        if (!H->used) continue;
        int64_t held = 0;
        for (uint32_t i = 1; i < ix->nused; i++)
            if (ix->nodes[i].nholders && is_held(ix, i, h)) held++;
        CHECK(held == H->size && (int64_t)map_len(&H->hash_of) == held, "holder size mismatch");
        for (uint64_t i = 0; i <= H->hash_of.mask; i++) {
            uint32_t s = (uint32_t)H->hash_of.slots[i].key;
            if (s == NIL) continue;
            CHECK(s < ix->nused && ix->nodes[s].nholders && is_held(ix, s, h), "a name for a block not held");
            CHECK(map_get(&H->by_hash, H->hash_of.slots[i].val, &v) && v == s, "first name not in by_hash");
        }
        uint64_t extras = 0;
        for (uint64_t i = 0; i <= H->extra.mask; i++) {
            uint32_t s = (uint32_t)H->extra.slots[i].key;
            if (s == NIL) continue;
            for (uint32_t x = (uint32_t)H->extra.slots[i].val; x; x = ix->xnext[x]) {
                CHECK(map_get(&H->by_hash, ix->xext[x], &v) && v == s, "extra name not in by_hash");
                extras++;
            }
        }
        CHECK(map_len(&H->by_hash) == map_len(&H->hash_of) + extras, "by_hash holds names of no block");
        total += H->size;
        PyObject *sz = PyDict_GetItem(ix->sizes, PyList_GET_ITEM(ix->keys, h));
        CHECK(sz != NULL && PyLong_AsLongLong(sz) == H->size, "sizes dict out of date");
    }
    CHECK(total == ix->total, "total mismatch");
    PyMem_Free(stack);
    Py_RETURN_NONE;
fail:
    PyMem_Free(stack);
    return NULL;
}

static PyObject *Index_num_nodes(Index *ix, PyObject *unused) { return PyLong_FromUnsignedLongLong(ix->nlive); }

/* memory_bytes() -> bytes allocated by the index's own arrays and tables (not the Python dicts). */
static PyObject *Index_memory_bytes(Index *ix, PyObject *unused) {
    size_t b = (size_t)ix->ncap * (sizeof(Node) + ix->W * sizeof(uint64_t)) + map_bytes(&ix->nodemap);
    b += (size_t)ix->xcap * (sizeof(uint64_t) + sizeof(uint32_t)) + ix->scap * sizeof(uint32_t);
    b += (size_t)ix->hcap * sizeof(Holder);
    for (uint32_t h = 0; h < ix->hcap; h++) {
        Holder *H = &ix->holders[h];
        if (H->used) b += map_bytes(&H->by_hash) + map_bytes(&H->hash_of) + map_bytes(&H->extra);
    }
    return PyLong_FromSize_t(b);
}

static PyObject *Index_get_total(Index *ix, void *closure) { return PyLong_FromLongLong(ix->total); }
static PyObject *Index_get_collisions(Index *ix, void *closure) { return PyLong_FromUnsignedLongLong(ix->collisions); }
static PyObject *Index_get_sizes(Index *ix, void *closure) { return Py_NewRef(ix->sizes); }

static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if ((kwds != NULL && PyDict_GET_SIZE(kwds)) || PyTuple_GET_SIZE(args)) {
        PyErr_SetString(PyExc_TypeError, "Index() takes no arguments");
        return NULL;
    }
    Index *ix = (Index *)type->tp_alloc(type, 0);
    if (ix == NULL) return NULL;
    ix->W = 1;
    ix->ncap = 1024;
    ix->nodes = PyMem_Calloc(ix->ncap, sizeof(Node));
    ix->masks = PyMem_Calloc(ix->ncap, sizeof(uint64_t));
    ix->keys = PyList_New(0);
    ix->sizes = PyDict_New();
    if (ix->nodes == NULL || ix->masks == NULL || ix->keys == NULL || ix->sizes == NULL || map_init(&ix->nodemap, 10) < 0) {
        Py_DECREF(ix);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    ix->nused = 1; /* node 0 is the root */
    ix->xused = 1; /* pool entry 0 is the end of a chain */
    return (PyObject *)ix;
}

static void Index_dealloc(Index *ix) {
    for (uint32_t h = 0; h < ix->hcap; h++) {
        if (!ix->holders[h].used) continue;
        map_free(&ix->holders[h].by_hash);
        map_free(&ix->holders[h].hash_of);
        map_free(&ix->holders[h].extra);
    }
    PyMem_Free(ix->holders);
    PyMem_Free(ix->nodes);
    PyMem_Free(ix->masks);
    map_free(&ix->nodemap);
    PyMem_Free(ix->xext);
    PyMem_Free(ix->xnext);
    PyMem_Free(ix->scratch);
    Py_XDECREF(ix->keys);
    Py_XDECREF(ix->sizes);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static PyMethodDef Index_methods[] = {
    {"register", (PyCFunction)Index_register, METH_O, "register(key) -> holder number"},
    {"unregister", (PyCFunction)Index_unregister, METH_VARARGS, "unregister(holder): forget it and its blocks"},
    {"store", (PyCFunction)Index_store, METH_VARARGS, "store(holder, parent_hash, blocks) -> applied"},
    {"store_chain", (PyCFunction)Index_store_chain, METH_VARARGS, "store_chain(holder, exts, keys, seqs)"},
    {"remove", (PyCFunction)Index_remove, METH_VARARGS, "remove(holder, hashes) -> blocks no longer held"},
    {"clear", (PyCFunction)Index_clear, METH_VARARGS, "clear(holder): it holds nothing"},
    {"match_local", (PyCFunction)Index_match_local, METH_O, "match_local(local hashes) -> {key: depth}"},
    {"match_seq", (PyCFunction)Index_match_seq, METH_O, "match_seq(sequence hashes) -> {key: depth}"},
    {"holds", (PyCFunction)Index_holds, METH_VARARGS, "holds(holder, engine hash) -> bool"},
    {"node_hash", (PyCFunction)Index_node_hash, METH_VARARGS, "node_hash(holder, engine hash) -> sequence hash | None"},
    {"dump", (PyCFunction)Index_dump, METH_VARARGS, "dump(holder) -> (chains, extras)"},
    {"check", (PyCFunction)Index_check, METH_NOARGS, "check(): raise AssertionError when inconsistent"},
    {"num_nodes", (PyCFunction)Index_num_nodes, METH_NOARGS, "distinct blocks in the tree"},
    {"memory_bytes", (PyCFunction)Index_memory_bytes, METH_NOARGS, "bytes held by the index's tables"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Index_getset[] = {
    {"total", (getter)Index_get_total, NULL, "blocks held, summed over holders", NULL},
    {"collisions", (getter)Index_get_collisions, NULL, "engine hashes reused for another block", NULL},
    {"sizes", (getter)Index_get_sizes, NULL, "live dict: holder key -> blocks held", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dynamod.shared.kv._kvcore.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Flat radix index of KV blocks per holder (see the module source).",
    .tp_new = Index_new,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
    .tp_getset = Index_getset,
};

static PyMethodDef module_methods[] = {
    {"block_hashes", py_block_hashes, METH_VARARGS, "block_hashes(tokens, block_size, seed) -> local hashes of full blocks"},
    {"sequence_hashes", py_sequence_hashes, METH_VARARGS, "sequence_hashes(local hashes, parent=None) -> chained hashes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kvcore_module = {
    PyModuleDef_HEAD_INIT, "_kvcore", "Compiled core of the KV index and block hashing.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kvcore(void) {
    str_block_hash = PyUnicode_InternFromString("block_hash");
    str_tokens_hash = PyUnicode_InternFromString("tokens_hash");
    if (str_block_hash == NULL || str_tokens_hash == NULL) return NULL;
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&kvcore_module);
    if (m == NULL) return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
