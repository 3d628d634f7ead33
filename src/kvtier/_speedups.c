/* kvtier._speedups: the scheduler's per-key hot path in C (optional; pure Python beside it).
 *
 * Lookup(index, pending, missed): the single-tier manager's lookup(key, req_context) as a
 *   C callable: True where the policy's index dict holds the key; else the key is appended
 *   to `missed` (the miss-cause log) unless `pending` holds it (being written), and False.
 *   The same logic as SingleTierManager._bound_lookup's closure, without a Python frame.
 *
 * key_hashes(keys, multipliers): the sketch's keyed 64-bit hash of each key (as a bytearray
 *   of uint64s in the machine's order) and the indices of the keys it leaves to the caller
 *   (not bytes, or too long for a row). The same function as kvtier.manager.causes.key_hashes' numpy
 *   path, word for word: a row is a length byte then the key's bytes, zero-padded to 48; the
 *   state takes each word by xor, an odd multiply and a xor-shift, then a final mix.
 *
 * probe(keys, start, stop, multipliers, slots, shift, moves): the cause sketch's record of
 *   each of keys[start:stop] (CauseSketch.words_at's answer, from the same hash, the same two
 *   buckets and the same first matching slot), without the hashes ever reaching Python.
 *
 * None keeps state between calls beyond the containers a Lookup was given; all run on the
 * calling thread with the GIL held.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define ROW_BYTES 48
#define WORDS (ROW_BYTES / 8)
#define LONG_KEY (ROW_BYTES - 1) /* a key this long or longer is hashed by the caller */
#define FINAL UINT64_C(0xFF51AFD7ED558CCD)
#define GOLDEN UINT32_C(0x9E3779B1) /* spreads a tag over the second bucket's offset */

typedef struct {
    PyObject_HEAD
    PyObject *index;   /* dict: the policy's index, key -> its entry */
    PyObject *pending; /* dict: keys being written */
    PyObject *missed;  /* list: the miss-cause log, or None (no causes) */
    vectorcallfunc vectorcall;
} Lookup;

static PyObject *
lookup_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Lookup *self = (Lookup *)op;
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "lookup(key, req_context) takes 2 positional arguments");
        return NULL;
    }
    PyObject *key = args[0];
    int found = PyDict_Contains(self->index, key);
    if (found != 0) {
        return found < 0 ? NULL : Py_NewRef(Py_True);
    }
    if (self->missed != Py_None) {
        int writing = PyDict_Contains(self->pending, key);
        if (writing < 0 || (!writing && PyList_Append(self->missed, key) < 0)) {
            return NULL;
        }
    }
    return Py_NewRef(Py_False);
}

static PyObject *
lookup_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *index, *pending, *missed;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Lookup(index, pending, missed) takes no keywords");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!O!O:Lookup", &PyDict_Type, &index, &PyDict_Type, &pending, &missed)) {
        return NULL;
    }
    if (missed != Py_None && !PyList_CheckExact(missed)) {
        PyErr_SetString(PyExc_TypeError, "Lookup: missed must be a list or None");
        return NULL;
    }
    Lookup *self = (Lookup *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->index = Py_NewRef(index);
    self->pending = Py_NewRef(pending);
    self->missed = Py_NewRef(missed);
    self->vectorcall = lookup_call;
    return (PyObject *)self;
}

static int
lookup_traverse(Lookup *self, visitproc visit, void *arg)
{
    Py_VISIT(self->index);
    Py_VISIT(self->pending);
    Py_VISIT(self->missed);
    return 0;
}

static int
lookup_clear(Lookup *self)
{
    Py_CLEAR(self->index);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->missed);
    return 0;
}

static void
lookup_dealloc(Lookup *self)
{
    PyObject_GC_UnTrack(self);
    lookup_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject LookupType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._speedups.Lookup",
    .tp_doc = "Lookup(index, pending, missed): the single-tier manager's lookup(key, req_context).",
    .tp_basicsize = sizeof(Lookup),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Lookup, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = lookup_new,
    .tp_traverse = (traverseproc)lookup_traverse,
    .tp_clear = (inquiry)lookup_clear,
    .tp_dealloc = (destructor)lookup_dealloc,
};

static uint64_t
load64(const unsigned char *p)
{
    uint64_t word; /* in the machine's order, as numpy's uint64 view of the same bytes */
    memcpy(&word, p, sizeof word);
    return word;
}

/* The hashes of keys[start:stop] into hashes[0 : stop - start]; the index (from start) of each
 * key it leaves to the caller (not bytes, or LONG_KEY bytes or more) appended to `left`, its
 * hash written as 0. 0 on success, -1 with an exception set. */
static int
hash_keys(PyObject *keys, Py_ssize_t start, Py_ssize_t stop, const uint64_t mult[WORDS],
          uint64_t *hashes, PyObject *left)
{
    Py_ssize_t count = stop - start;
    /* every row first, then every hash: a row's words are loaded long after its bytes were
     * stored (a load over several fresh stores waits for them), and keys' multiplies overlap */
    unsigned char *rows = PyMem_Calloc((size_t)count + 1, ROW_BYTES);
    if (rows == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        if (start + k >= PyList_GET_SIZE(keys)) { /* a finalizer run by an allocation shrank it */
            PyErr_SetString(PyExc_RuntimeError, "the list of keys shrank while it was hashed");
            PyMem_Free(rows);
            return -1;
        }
        PyObject *key = PyList_GET_ITEM(keys, start + k);
        unsigned char *row = rows + ROW_BYTES * k;
        if (PyBytes_Check(key) && PyBytes_GET_SIZE(key) < LONG_KEY) {
            row[0] = (unsigned char)PyBytes_GET_SIZE(key);
            memcpy(row + 1, PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key));
            continue;
        }
        PyObject *at = PyLong_FromSsize_t(k);
        if (at == NULL || PyList_Append(left, at) < 0) {
            Py_XDECREF(at);
            PyMem_Free(rows);
            return -1;
        }
        Py_DECREF(at);
        row[0] = 0xFF; /* no key's length: marks the row */
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        const unsigned char *row = rows + ROW_BYTES * k;
        uint64_t h = load64(row) * mult[0];
        h ^= h >> 29;
        for (int c = 1; c < WORDS; c++) {
            h ^= load64(row + 8 * c);
            h *= mult[c];
            h ^= h >> 29;
        }
        h *= FINAL;
        h ^= h >> 32;
        hashes[k] = row[0] == 0xFF ? 0 : h;
    }
    PyMem_Free(rows);
    return 0;
}

/* The multipliers from their bytes; 0, or -1 with an exception set. */
static int
read_multipliers(Py_buffer *secret, uint64_t mult[WORDS])
{
    if (secret->len != 8 * WORDS) {
        PyErr_Format(PyExc_ValueError, "multipliers must be %d bytes", 8 * WORDS);
        return -1;
    }
    for (int i = 0; i < WORDS; i++) {
        mult[i] = load64((const unsigned char *)secret->buf + 8 * i);
    }
    return 0;
}

/* A slice's bounds, clipped to the list as Python's slicing does. */
static void
clip(PyObject *keys, Py_ssize_t *start, Py_ssize_t *stop)
{
    Py_ssize_t size = PyList_GET_SIZE(keys);
    *start = *start < 0 ? 0 : (*start > size ? size : *start);
    *stop = *stop < *start ? *start : (*stop > size ? size : *stop);
}

static PyObject *
key_hashes(PyObject *module, PyObject *args)
{
    PyObject *keys, *out = NULL, *left = NULL;
    Py_buffer secret;
    uint64_t mult[WORDS];
    if (!PyArg_ParseTuple(args, "O!y*:key_hashes", &PyList_Type, &keys, &secret)) {
        return NULL;
    }
    int bad = read_multipliers(&secret, mult);
    PyBuffer_Release(&secret);
    if (bad) {
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(keys);
    out = PyByteArray_FromStringAndSize(NULL, 8 * count);
    left = PyList_New(0);
    if (out == NULL || left == NULL ||
        hash_keys(keys, 0, count, mult, (uint64_t *)PyByteArray_AS_STRING(out), left) < 0) {
        Py_XDECREF(out);
        Py_XDECREF(left);
        return NULL;
    }
    return Py_BuildValue("(NN)", out, left);
}

/* Each hash's record in a table of `buckets` 4-slot buckets (see probe). */
static void
read_records(const uint64_t *hashes, Py_ssize_t count, const uint32_t *slots, uint64_t buckets,
             unsigned int shift, uint64_t moves, unsigned char *found)
{
    for (Py_ssize_t k = 0; k < count; k++) {
        uint32_t half[2]; /* the hash's two 32-bit halves as numpy's uint32 view has them */
        memcpy(half, &hashes[k], sizeof half);
        uint32_t tag = half[1] >> shift;
        tag |= tag == 0; /* 0 marks an empty slot */
        uint64_t first = ((uint64_t)half[0] * buckets) >> 32;
        uint64_t second = first + ((((uint64_t)(uint32_t)(tag * GOLDEN)) * moves) >> 32) + 1;
        if (second >= buckets) {
            second -= buckets;
        }
        const uint32_t *one = slots + 4 * first, *two = slots + 4 * second;
        uint32_t record = 0;
        for (int i = 0; i < 8; i++) {
            uint32_t slot = i < 4 ? one[i] : two[i - 4];
            if (slot >> 8 == tag) {
                record = slot & 0xFF;
                break;
            }
        }
        found[k] = (unsigned char)record;
    }
}

/* What CauseSketch.words_at answers, for keys[start:stop]: each key's record byte from a
 * table of 4-slot buckets (uint32 slots: a tag above a record byte), 0 where no slot of its
 * two buckets holds its tag. The keys left to the caller (key_hashes') get 0. */
static PyObject *
probe(PyObject *module, PyObject *args)
{
    PyObject *keys, *out = NULL, *left = NULL;
    Py_buffer secret, table;
    Py_ssize_t start, stop;
    unsigned int shift;
    unsigned long long moves;
    uint64_t mult[WORDS], *hashes = NULL;
    if (!PyArg_ParseTuple(args, "O!nny*y*IK:probe", &PyList_Type, &keys, &start, &stop, &secret, &table,
                          &shift, &moves)) {
        return NULL;
    }
    Py_ssize_t buckets = table.len / (4 * (Py_ssize_t)sizeof(uint32_t));
    if (read_multipliers(&secret, mult) < 0) {
        goto done;
    }
    if (shift < 8 || shift > 31 || buckets < 2 || table.len % (4 * sizeof(uint32_t)) != 0 ||
        moves != (unsigned long long)(buckets - 1)) {
        PyErr_SetString(PyExc_ValueError, "probe: a table of 4-slot buckets, 8 <= shift < 32, moves = buckets - 1");
        goto done;
    }
    clip(keys, &start, &stop);
    Py_ssize_t count = stop - start;
    out = PyBytes_FromStringAndSize(NULL, count);
    left = PyList_New(0);
    hashes = PyMem_Malloc(sizeof(uint64_t) * ((size_t)count + 1));
    if (out == NULL || left == NULL || hashes == NULL) {
        if (hashes == NULL) {
            PyErr_NoMemory();
        }
        goto fail;
    }
    if (hash_keys(keys, start, stop, mult, hashes, left) < 0) {
        goto fail;
    }
    read_records(hashes, count, table.buf, (uint64_t)buckets, shift, moves,
                 (unsigned char *)PyBytes_AS_STRING(out));
    goto done;
fail:
    Py_CLEAR(out);
    Py_CLEAR(left);
done:
    PyMem_Free(hashes);
    PyBuffer_Release(&secret);
    PyBuffer_Release(&table);
    return out == NULL ? NULL : Py_BuildValue("(NN)", out, left);
}

static PyMethodDef methods[] = {
    {"key_hashes", key_hashes, METH_VARARGS,
     "key_hashes(keys: list, multipliers: bytes) -> (bytearray of uint64 hashes, indices left to the caller)"},
    {"probe", probe, METH_VARARGS,
     "probe(keys: list, start, stop, multipliers: bytes, slots, shift, moves) -> (record bytes, indices left)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier._speedups", "kvtier's scheduler hot path in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if (PyType_Ready(&LookupType) < 0) {
        return NULL;
    }
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(mod, "Lookup", (PyObject *)&LookupType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
