/*
 * The router's per-decision loops over candidate workers and active blocks: the compiled module
 * dynamod.daemon.router.core._schedcore, beside the router core it speeds up (the KV index's own
 * compiled core, shared/kv/_native/kvcore.c, is a separate module; both use its u64map.h).
 *
 * Why C: at a thousand workers one routing decision scores every candidate, and in Python that
 * loop (a few dict lookups, integer arithmetic and one CandidateScore per worker) was most of the
 * decision's time; so were adding and freeing a request's 512 active-block references and the
 * binary searches for prompt blocks already active on a worker (ActiveBlocks). The reference semantics are the Python
 * code in daemon/router/core/scheduler.py (KvScheduler._score_python, KvScheduler.select) and
 * daemon/router/core/active_sequences.py; both paths are tested against each other on random inputs.
 *
 * Exactness: costs are compared as exact integer keys. Here they are int64 and every float in the
 * result is an int64 quotient; when a value would not fit, or would not convert to a double
 * exactly (beyond 2**53, where Python's correctly rounded int division and a C division could
 * differ), score_candidates returns None and the caller takes the Python path. So the two paths
 * agree bit for bit on every input, and the compiled one is simply not used for absurd weights.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "u64map.h"

#define EXACT_DOUBLE_MAX (INT64_C(1) << 53)

/* An exact int as int64. 1 on success, 0 when it is not an exact int or does not fit (no error
 * left set), -1 on another error. */
static inline int small_int(PyObject *o, int64_t *out) {
    if (!PyLong_CheckExact(o)) return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow) return 0;
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 1;
}

static inline int exact_as_double(int64_t v) { return v <= EXACT_DOUBLE_MAX && v >= -EXACT_DOUBLE_MAX; }

/* d.get(key) without a new reference; NULL with no error when missing (or d is None or empty).
 * A candidate is looked up in four dicts, so its tuple hash is computed once and passed in where
 * CPython lets us (the known-hash lookup is not in the limited API and left 3.13's headers). */
static inline PyObject *dict_get(PyObject *d, PyObject *key, Py_hash_t hash, int *err) {
    if (d == Py_None || PyDict_GET_SIZE(d) == 0) return NULL;
#if PY_VERSION_HEX < 0x030D0000
    PyObject *v = _PyDict_GetItem_KnownHash(d, key, hash);
#else
    (void)hash;
    PyObject *v = PyDict_GetItemWithError(d, key);
#endif
    if (v == NULL && PyErr_Occurred()) *err = 1;
    return v;
}

#define INEXACT 1 /* returned by score_one: take the Python path */

typedef struct {
    PyObject *overlaps, *tree_sizes, *lower, *terms, *shared, *score_type, *zero;
    int64_t isl, bs, a, decode_scale, scale, host_units, disk_units, request_blocks;
    int tiered;
} ScoreArgs;

/* One candidate's CandidateScore and key (see KvScheduler._score_python for the formulas).
 * 0 on success, INEXACT, or -1 with an error set. */
static int score_one(const ScoreArgs *s, PyObject *worker, PyObject **score_out, int64_t *key_out) {
    if (!PyTuple_CheckExact(worker) || PyTuple_GET_SIZE(worker) < 2) {
        PyErr_SetString(PyExc_TypeError, "candidates must be (worker_id, dp_rank) tuples");
        return -1;
    }
    int err = 0, ok;
    Py_hash_t hash = PyObject_Hash(worker);
    if (hash == -1) return -1;
    PyObject *overlap_obj = dict_get(s->overlaps, worker, hash, &err);
    if (err) return -1;
    if (overlap_obj == NULL) overlap_obj = s->zero;
    int64_t overlap;
    if ((ok = small_int(overlap_obj, &overlap)) <= 0) return ok < 0 ? -1 : INEXACT;

    int64_t uncached, prefill_tokens, decode_blocks;
    if (__builtin_mul_overflow(overlap, s->bs, &uncached) || __builtin_sub_overflow(s->isl, uncached, &uncached))
        return INEXACT;
    if (uncached < 0) uncached = 0;
    PyObject *load = dict_get(s->terms, worker, hash, &err);
    if (err) return -1;
    if (load == NULL) {
        prefill_tokens = uncached;
        if (__builtin_sub_overflow(s->request_blocks, overlap, &decode_blocks)) return INEXACT;
    } else {
        if (!PyTuple_CheckExact(load) || PyTuple_GET_SIZE(load) < 2) {
            PyErr_SetString(PyExc_TypeError, "load terms must be (active_blocks, prefill_tokens) tuples");
            return -1;
        }
        int64_t active_blocks, load_prefill, shared = 0;
        if ((ok = small_int(PyTuple_GET_ITEM(load, 0), &active_blocks)) <= 0) return ok < 0 ? -1 : INEXACT;
        if ((ok = small_int(PyTuple_GET_ITEM(load, 1), &load_prefill)) <= 0) return ok < 0 ? -1 : INEXACT;
        PyObject *shared_obj = dict_get(s->shared, worker, hash, &err);
        if (err) return -1;
        if (shared_obj != NULL && (ok = small_int(shared_obj, &shared)) <= 0) return ok < 0 ? -1 : INEXACT;
        int64_t reused = shared > overlap ? shared : overlap;
        if (__builtin_add_overflow(load_prefill, uncached, &prefill_tokens) ||
            __builtin_add_overflow(active_blocks, s->request_blocks, &decode_blocks) ||
            __builtin_sub_overflow(decode_blocks, reused, &decode_blocks))
            return INEXACT;
    }

    int64_t host = 0, disk = 0, credited = 0, prefill_scaled, key, t1, t2;
    PyObject *host_obj = s->zero, *disk_obj = s->zero;
    if (s->tiered) {
        PyObject *tiers = dict_get(s->lower, worker, hash, &err);
        if (err) return -1;
        if (tiers != NULL) {
            if (!PyTuple_CheckExact(tiers) || PyTuple_GET_SIZE(tiers) < 2) return INEXACT;
            host_obj = PyTuple_GET_ITEM(tiers, 0);
            disk_obj = PyTuple_GET_ITEM(tiers, 1);
            if ((ok = small_int(host_obj, &host)) <= 0) return ok < 0 ? -1 : INEXACT;
            if ((ok = small_int(disk_obj, &disk)) <= 0) return ok < 0 ? -1 : INEXACT;
        }
        if (__builtin_mul_overflow(host, s->host_units, &t1) || __builtin_mul_overflow(disk, s->disk_units, &t2) ||
            __builtin_add_overflow(t1, t2, &credited))
            return INEXACT;
    }
    if (__builtin_mul_overflow(prefill_tokens, s->scale, &prefill_scaled) ||
        __builtin_sub_overflow(prefill_scaled, credited, &prefill_scaled) ||
        __builtin_mul_overflow(s->a, prefill_scaled, &t1) ||
        __builtin_mul_overflow(s->decode_scale, decode_blocks, &t2) || __builtin_add_overflow(t1, t2, &key))
        return INEXACT;
    int64_t prefill_den = s->bs * s->scale; /* checked by the caller */
    if (!exact_as_double(prefill_scaled) || !exact_as_double(key) || !exact_as_double(credited)) return INEXACT;

    PyObject *tree = dict_get(s->tree_sizes, worker, hash, &err);
    if (err) return -1;
    if (tree == NULL) tree = s->zero;

    PyObject *args[12] = {NULL};
    int nargs = s->tiered ? 12 : 8;
    args[0] = Py_NewRef(PyTuple_GET_ITEM(worker, 0));
    args[1] = Py_NewRef(PyTuple_GET_ITEM(worker, 1));
    args[2] = Py_NewRef(overlap_obj);
    args[3] = PyLong_FromLongLong(prefill_tokens);
    args[4] = PyFloat_FromDouble((double)prefill_scaled / (double)prefill_den);
    args[5] = PyLong_FromLongLong(decode_blocks);
    args[6] = PyFloat_FromDouble((double)key / (double)s->decode_scale);
    args[7] = Py_NewRef(tree);
    if (s->tiered) {
        args[8] = Py_NewRef(Py_None);
        args[9] = Py_NewRef(host_obj);
        args[10] = Py_NewRef(disk_obj);
        args[11] = PyFloat_FromDouble((double)credited / (double)prefill_den);
    }
    PyObject *score = NULL;
    int i;
    for (i = 0; i < nargs; i++)
        if (args[i] == NULL) break;
    if (i == nargs) score = PyObject_Vectorcall(s->score_type, args, (size_t)nargs, NULL);
    for (i = 0; i < nargs; i++) Py_XDECREF(args[i]);
    if (score == NULL) return -1;
    *score_out = score;
    *key_out = key;
    return 0;
}

static int dict_or_none(PyObject *o, const char *what) {
    if (o == Py_None || PyDict_Check(o)) return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a dict or None, got %.100s", what, Py_TYPE(o)->tp_name);
    return -1;
}

PyDoc_STRVAR(score_candidates_doc,
             "score_candidates(candidates, overlaps, tree_sizes, lower, terms, shared, score_type, isl, block_size,\n"
             "                 a, decode_scale, scale, host_units, disk_units) -> (scores, keys) | None\n\n"
             "Each candidate's CandidateScore and exact integer cost key, as KvScheduler._score_python\n"
             "computes them; None when a value falls outside exact int64/double arithmetic.");

static PyObject *py_score_candidates(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 14) {
        PyErr_Format(PyExc_TypeError, "score_candidates takes 14 arguments, got %zd", argc);
        return NULL;
    }
    ScoreArgs s;
    PyObject *candidates = argv[0];
    s.overlaps = argv[1];
    s.tree_sizes = argv[2];
    s.lower = argv[3];
    s.terms = argv[4];
    s.shared = argv[5];
    s.score_type = argv[6];
    if (dict_or_none(s.overlaps, "overlaps") || dict_or_none(s.tree_sizes, "tree_sizes") ||
        dict_or_none(s.lower, "lower") || dict_or_none(s.terms, "terms") || dict_or_none(s.shared, "shared"))
        return NULL;
    if (!PyCallable_Check(s.score_type)) {
        PyErr_SetString(PyExc_TypeError, "score_type must be callable");
        return NULL;
    }
    int64_t *ints[7] = {&s.isl, &s.bs, &s.a, &s.decode_scale, &s.scale, &s.host_units, &s.disk_units};
    for (int i = 0; i < 7; i++) {
        int ok = small_int(argv[7 + i], ints[i]);
        if (ok < 0) return NULL;
        if (ok == 0) Py_RETURN_NONE;
    }
    if (s.bs <= 0 || s.decode_scale <= 0 || s.scale <= 0 || s.isl < 0 || s.a < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size, decode_scale and scale must be positive; isl and a >= 0");
        return NULL;
    }
    int64_t den;
    if (__builtin_mul_overflow(s.bs, s.scale, &den) || !exact_as_double(den) || !exact_as_double(s.decode_scale))
        Py_RETURN_NONE;
    s.request_blocks = s.isl / s.bs + (s.isl % s.bs != 0);
    s.tiered = s.lower != Py_None && PyDict_GET_SIZE(s.lower) > 0;
    PyObject *fast = PySequence_Fast(candidates, "candidates must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *scores = PyList_New(n), *keys = PyList_New(n), *result = NULL;
    s.zero = PyLong_FromLong(0);
    if (scores == NULL || keys == NULL || s.zero == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *score;
        int64_t key;
        int rc = score_one(&s, items[i], &score, &key);
        if (rc < 0) goto done;
        if (rc == INEXACT) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyList_SET_ITEM(scores, i, score);
        PyObject *key_obj = PyLong_FromLongLong(key);
        if (key_obj == NULL) goto done;
        PyList_SET_ITEM(keys, i, key_obj);
    }
    result = PyTuple_Pack(2, scores, keys);
done:
    Py_XDECREF(s.zero);
    Py_XDECREF(scores);
    Py_XDECREF(keys);
    Py_DECREF(fast);
    return result;
}

PyDoc_STRVAR(lowest_keys_doc,
             "lowest_keys(keys) -> (best, ties, runner_up) | None\n\n"
             "The first index of the smallest key, how many keys equal it, and the first index of the\n"
             "smallest among the others (-1 with one key); None when a key is not an int64.");

static PyObject *py_lowest_keys(PyObject *self, PyObject *keys) {
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no keys");
        return NULL;
    }
    /* One pass: the smallest (first of equals), how many equal it, and the best of the rest. */
    Py_ssize_t best = -1, second = -1, ties = 0;
    int64_t best_key = 0, second_key = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k;
        int ok = small_int(PyList_GET_ITEM(keys, i), &k);
        if (ok < 0) return NULL;
        if (ok == 0) Py_RETURN_NONE;
        if (best < 0 || k < best_key) {
            if (best >= 0 && (second < 0 || best_key < second_key || (best_key == second_key && best < second))) {
                second = best;
                second_key = best_key;
            }
            best = i;
            best_key = k;
            ties = 1;
        } else {
            if (k == best_key) ties++;
            if (second < 0 || k < second_key) {
                second = i;
                second_key = k;
            }
        }
    }
    return Py_BuildValue("nnn", best, ties, second);
}

/* ------------------------------------------------------------------------------------------ */
/* ActiveBlocks: one worker's active blocks, sequence hash -> number of active requests using it.
 * The same job as a Counter of Python ints, but flat: the router adds and releases a request's
 * hundreds of blocks on every route and free, and searches a prompt against the active blocks of
 * every worker whose requests start like it; as a dict each probe chased a table index, an entry
 * and the key's int object through memory, here it is one slot read. Hashes are u64 (other ints
 * are taken modulo 2**64, as in the index). */

typedef struct {
    PyObject_HEAD
    Map map;
} ActiveBlocks;

static inline int hash_u64(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "expected an int hash, got %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = PyLong_AsUnsignedLongLongMask(o);
    if (*out == (uint64_t)-1 && PyErr_Occurred()) return -1;
    return 0;
}

static PyObject *ActiveBlocks_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "ActiveBlocks() takes no arguments");
        return NULL;
    }
    ActiveBlocks *self = (ActiveBlocks *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    if (map_init(&self->map, 4) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void ActiveBlocks_dealloc(ActiveBlocks *self) {
    map_free(&self->map);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Calls fn(self, hash) for each hash of a sequence; -1 on the first failure. */
static int for_each_hash(ActiveBlocks *self, PyObject *hashes, int (*fn)(ActiveBlocks *, uint64_t)) {
    PyObject *fast = PySequence_Fast(hashes, "hashes must be a sequence of ints");
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h;
        if (hash_u64(items[i], &h) < 0 || fn(self, h) < 0) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static int add_one(ActiveBlocks *self, uint64_t h) {
    uint64_t c = 0;
    map_get(&self->map, h, &c);
    return map_put(&self->map, h, c + 1);
}

static int release_one(ActiveBlocks *self, uint64_t h) {
    uint64_t c;
    if (!map_get(&self->map, h, &c)) return 0; /* not active: nothing to release */
    if (c <= 1) return map_del(&self->map, h, NULL) < 0 ? -1 : 0;
    return map_put(&self->map, h, c - 1);
}

static PyObject *ActiveBlocks_add(ActiveBlocks *self, PyObject *hashes) {
    if (for_each_hash(self, hashes, add_one) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *ActiveBlocks_release(ActiveBlocks *self, PyObject *hashes) {
    if (for_each_hash(self, hashes, release_one) < 0) return NULL;
    Py_RETURN_NONE;
}

static inline int is_active(ActiveBlocks *self, PyObject *seq_hash, int *err) {
    uint64_t h, c;
    if (hash_u64(seq_hash, &h) < 0) {
        *err = 1;
        return 0;
    }
    return map_get(&self->map, h, &c);
}

/* The result r has blocks [0, r) active and [r, n) not (the active set is prefix-closed along a
 * prompt), so a binary search finds it. ``hint`` is a guess (the previous worker's answer: many
 * workers' active requests end at the same place, e.g. a shared system prompt); when right it is
 * confirmed in two probes instead of log2(n), and the answer never depends on it. */
static PyObject *ActiveBlocks_shared_prefix(ActiveBlocks *self, PyObject *const *argv, Py_ssize_t argc) {
    if (argc < 1 || argc > 2) {
        PyErr_SetString(PyExc_TypeError, "shared_prefix(seq_hashes, hint=0)");
        return NULL;
    }
    Py_ssize_t hint = 0;
    if (argc == 2) {
        hint = PyLong_AsSsize_t(argv[1]);
        if (hint == -1 && PyErr_Occurred()) return NULL;
    }
    PyObject *fast = PySequence_Fast(argv[0], "seq_hashes must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), lo = 0, hi = n;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int err = 0;
    if (n == 0 || map_len(&self->map) == 0) {
        hi = 0;
    } else if (hint >= 1 && hint <= n) {
        if (is_active(self, items[hint - 1], &err)) {
            lo = hint;
            if (hint < n && !err) {
                if (is_active(self, items[hint], &err))
                    lo = hint + 1;
                else
                    hi = hint;
            }
        } else {
            hi = hint - 1;
        }
    } else if (!is_active(self, items[0], &err)) {
        hi = 0;
    } else {
        lo = 1;
    }
    while (lo < hi && !err) { /* items[:lo] are active; find the largest such lo */
        Py_ssize_t mid = (lo + hi + 1) / 2;
        if (is_active(self, items[mid - 1], &err))
            lo = mid;
        else
            hi = mid - 1;
    }
    Py_DECREF(fast);
    return err ? NULL : PyLong_FromSsize_t(lo);
}

static PyObject *ActiveBlocks_count(ActiveBlocks *self, PyObject *hash) {
    uint64_t h, c = 0;
    if (hash_u64(hash, &h) < 0) return NULL;
    map_get(&self->map, h, &c);
    return PyLong_FromUnsignedLongLong(c);
}

static PyObject *ActiveBlocks_memory_bytes(ActiveBlocks *self, PyObject *unused) {
    return PyLong_FromSize_t(sizeof(ActiveBlocks) + map_bytes(&self->map));
}

static Py_ssize_t ActiveBlocks_len(ActiveBlocks *self) { return (Py_ssize_t)map_len(&self->map); }

static int ActiveBlocks_contains(ActiveBlocks *self, PyObject *hash) {
    uint64_t h, c;
    if (!PyLong_Check(hash)) return 0;
    if (hash_u64(hash, &h) < 0) return -1;
    return map_get(&self->map, h, &c);
}

static PyMethodDef ActiveBlocks_methods[] = {
    {"add", (PyCFunction)ActiveBlocks_add, METH_O, "add(seq_hashes): one more active request uses each block"},
    {"release", (PyCFunction)ActiveBlocks_release, METH_O,
     "release(seq_hashes): one active request fewer uses each block; unused blocks are dropped"},
    {"shared_prefix", (PyCFunction)(void (*)(void))ActiveBlocks_shared_prefix, METH_FASTCALL,
     "shared_prefix(seq_hashes, hint=0) -> leading blocks active here (hint: a guess, e.g. another worker's answer)"},
    {"count", (PyCFunction)ActiveBlocks_count, METH_O, "count(seq_hash) -> active requests using the block"},
    {"memory_bytes", (PyCFunction)ActiveBlocks_memory_bytes, METH_NOARGS, "bytes held by its table"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods ActiveBlocks_as_sequence = {
    .sq_length = (lenfunc)ActiveBlocks_len,
    .sq_contains = (objobjproc)ActiveBlocks_contains,
};

static PyTypeObject ActiveBlocksType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dynamod.shared.kv._kvcore.ActiveBlocks",
    .tp_basicsize = sizeof(ActiveBlocks),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One worker's active blocks: sequence hash -> active requests using it (distinct blocks by len()).",
    .tp_new = ActiveBlocks_new,
    .tp_dealloc = (destructor)ActiveBlocks_dealloc,
    .tp_methods = ActiveBlocks_methods,
    .tp_as_sequence = &ActiveBlocks_as_sequence,
};

static PyMethodDef kv_sched_methods[] = {
    {"score_candidates", (PyCFunction)(void (*)(void))py_score_candidates, METH_FASTCALL, score_candidates_doc},
    {"lowest_keys", py_lowest_keys, METH_O, lowest_keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef schedcore_module = {
    PyModuleDef_HEAD_INIT, "_schedcore", "Compiled per-decision loops of the KV router's scheduler.", -1,
    kv_sched_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__schedcore(void) {
    if (PyType_Ready(&ActiveBlocksType) < 0) return NULL;
    PyObject *m = PyModule_Create(&schedcore_module);
    if (m == NULL) return NULL;
    Py_INCREF(&ActiveBlocksType);
    if (PyModule_AddObject(m, "ActiveBlocks", (PyObject *)&ActiveBlocksType) < 0) {
        Py_DECREF(&ActiveBlocksType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
