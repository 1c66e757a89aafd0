/*
 * simpler_daemon.mailbox._mailbox -- offsets and atomics for the shared-memory
 * mailboxes the daemon parent uses to talk to its forked worker children.
 *
 * This is deliberately a tiny shim: it knows the frame layout, how to do
 * acquire/release/seq_cst accesses on words inside a writable buffer
 * (mmap.mmap, bytearray, writable memoryview), and how to park on / wake a
 * futex that lives in MAP_SHARED memory.  It knows no policy.
 *
 * Every entry point acquires the buffer with PyBUF_WRITABLE, checks bounds
 * and alignment before touching memory (raising IndexError / ValueError,
 * never crashing) and releases the buffer on every path.
 *
 * Linux only (x86_64 / aarch64): GCC __atomic builtins and SYS_futex.
 *
 * The sources: _mailbox.h (layout, inline helpers, declarations),
 * _mailbox_args.c (argument converters), _mailbox_atomics.c (atomics, futex),
 * _mailbox_wait.c (spin / park), _mailbox_frame.c (frame access),
 * _mailbox_process.c (process controls), _mailbox_pump.c (the SUB pump),
 * _mailbox_gc.c (the collector's tracking of task records) and this file (the
 * method table and module init).
 */
#include "_mailbox.h"

/* ------------------------------------------------------------------------ */
/* Module                                                                   */
/* ------------------------------------------------------------------------ */

#define FASTCALL(name, doc) {#name, (PyCFunction)(void (*)(void))mb_##name, METH_FASTCALL, doc}
#define KWCALL(name, doc)                                                                     \
    {#name, (PyCFunction)(void (*)(void))mb_##name, METH_VARARGS | METH_KEYWORDS, doc}

static PyMethodDef mailbox_methods[] = {
    FASTCALL(load32, "load32(buf, off, /) -> int: acquire load of a signed 32-bit word."),
    FASTCALL(load64, "load64(buf, off, /) -> int: acquire load of an unsigned 64-bit word."),
    FASTCALL(store32, "store32(buf, off, value, /) -> None: seq_cst store of a 32-bit word."),
    FASTCALL(store64, "store64(buf, off, value, /) -> None: seq_cst store of a 64-bit word."),
    FASTCALL(cas32, "cas32(buf, off, expected, desired, /) -> bool: seq_cst strong CAS."),
    FASTCALL(cas64, "cas64(buf, off, expected, desired, /) -> bool: seq_cst strong CAS."),
    FASTCALL(fetch_add32, "fetch_add32(buf, off, delta, /) -> int: returns the old value."),
    FASTCALL(fetch_add64, "fetch_add64(buf, off, delta, /) -> int: returns the old value."),
    {"fence", mb_fence, METH_NOARGS, "fence() -> None: seq_cst thread fence."},
    KWCALL(futex_wait,
           "futex_wait(buf, off, expected, timeout=None) -> int: 0 woken, 1 timed out, "
           "2 value != expected, 3 interrupted."),
    FASTCALL(futex_wake, "futex_wake(buf, off, n, /) -> int: number of waiters woken."),
    FASTCALL(spin_wait,
             "spin_wait(buf, offsets, expected, spins, /) -> int: index of the first 32-bit "
             "word that differs from its expected value, or -1 when the spin budget runs out."),
    KWCALL(child_wait,
           "child_wait(buf, offsets, expected, spin_ns, timeout) -> int: spin for spin_ns, "
           "then park on the mailbox wake futex; index of the changed word or -1."),
    FASTCALL(child_claim,
             "child_claim(buf, hold, /) -> int: a SUB child's next task frame over its two "
             "task frames, claimed (TASK_READY -> TASK_LAUNCHED): its offset; 0 none ready; "
             "-1 while the frame at `hold` still says TASK_DONE."),
    {"wake_child", mb_wake_child, METH_O,
     "wake_child(buf, /) -> bool: wake the mailbox's child if it is parked."},
    KWCALL(publish_task, "publish_task(...) -> None: write a task into an idle frame, store "
                         "its state and wake the child."),
    KWCALL(read_task, "read_task(buf, frame_off) -> tuple: (config, slot_id, generation, "
                      "digest, blob, protocol, run_id, trailer_slot_id, trailer_generation, "
                      "dispatch_id)."),
    FASTCALL(child_take,
             "child_take(buf, frame_off, /) -> (deadline_ms, digest, blob): a SUB child's "
             "read of the task it claimed, after storing its pick-up word."),
    FASTCALL(child_done,
             "child_done(buf, frame_off, doorbell, /) -> bool: a SUB task's plain end "
             "(TASK_DONE, no error) and the doorbell's count + 1; True if the parent is "
             "parked."),
    KWCALL(read_trailer, "read_trailer(buf, frame_off) -> tuple: (protocol, run_id, slot_id, "
                         "generation, dispatch_id)."),
    KWCALL(write_result, "write_result(buf, frame_off, state, error, message) -> None."),
    KWCALL(read_result, "read_result(buf, frame_off) -> tuple: (state, error, message, "
                        "accepted, disposition, protocol, run_id, slot_id, generation, "
                        "dispatch_id)."),
    KWCALL(read_bytes, "read_bytes(buf, off, n) -> bytes."),
    KWCALL(write_bytes, "write_bytes(buf, off, data) -> None."),
    {"set_pdeathsig", mb_set_pdeathsig, METH_O,
     "set_pdeathsig(signum, /) -> None: prctl(PR_SET_PDEATHSIG)."},
    {"fork_sibling", mb_fork_sibling, METH_NOARGS,
     "fork_sibling() -> int: fork a child of this process's parent (CLONE_PARENT); 0 in "
     "the child."},
    FASTCALL(sub_pump,
             "sub_pump(lanes, queue, ready, published, spin_ns, max_publish, queue_frames=1, /) "
             "-> int: the per-task loop of SUB lanes over one ready queue (poll, complete, "
             "publish the next; queue a task behind a busy child only with queue_frames); "
             "returns how many slots it published."),
    {"gc_untrack", mb_gc_untrack, METH_O,
     "gc_untrack(obj, /) -> None: take obj off the cyclic collector's lists (no-op when "
     "untracked or not a collector type)."},
    {"gc_track_all", mb_gc_track_all, METH_O,
     "gc_track_all(objs, /) -> None: put every untracked collector object of the list "
     "objs back on the collector's lists."},
    {NULL, NULL, 0, NULL},
};

static int
add_int(PyObject *m, const char *name, long value)
{
    return PyModule_AddIntConstant(m, name, value);
}

static int
mailbox_exec(PyObject *m)
{
    if (mb_pump_init() < 0) {
        return -1;
    }
    static const struct {
        const char *name;
        long value;
    } consts[] = {
        {"ABI_VERSION", ABI_VERSION},
        {"MAILBOX_FRAME_SIZE", MAILBOX_FRAME_SIZE},
        {"MAILBOX_NUM_FRAMES", MAILBOX_NUM_FRAMES},
        {"MAILBOX_SIZE", MAILBOX_SIZE},
        {"OFF_STATE", OFF_STATE},
        {"OFF_ERROR", OFF_ERROR},
        {"OFF_RESERVED", OFF_RESERVED},
        {"OFF_CONFIG", OFF_CONFIG},
        {"CONFIG_SIZE", CONFIG_SIZE},
        {"OFF_LEASE", OFF_LEASE},
        {"OFF_DIGEST", OFF_DIGEST},
        {"DIGEST_SIZE", DIGEST_SIZE},
        {"OFF_ARGS", OFF_ARGS},
        {"MAILBOX_ARGS_CAPACITY", MAILBOX_ARGS_CAPACITY},
        {"OFF_WAKE_SEQ", OFF_WAKE_SEQ},
        {"OFF_CHILD_PARKED", OFF_CHILD_PARKED},
        {"OFF_SHUTDOWN", OFF_SHUTDOWN},
        {"OFF_TRAILER", OFF_TRAILER},
        {"TRAILER_SIZE", TRAILER_SIZE},
        {"OFF_ACCEPTED", OFF_ACCEPTED},
        {"OFF_DISPOSITION", OFF_DISPOSITION},
        {"OFF_ERRMSG", OFF_ERRMSG},
        {"ERRMSG_SIZE", ERRMSG_SIZE},
        {"TENSOR_DESC_SIZE", TENSOR_DESC_SIZE},
        {"SUBPUMP_FIELDS", SUBPUMP_FIELDS},
        {"DOORBELL_OFF_PARKED", DOORBELL_OFF_PARKED},
        {"DOORBELL_OFF_COMPLETED", DOORBELL_OFF_COMPLETED},
        {"DOORBELL_SIZE", DOORBELL_SIZE},
        {"SUBPUMP_MAX_LANES", SUBPUMP_MAX_LANES},
        {"SUBPUMP_MAX_RESULT", SUBPUMP_MAX_RESULT},
        {"VALUES_MAGIC", VALUES_MAGIC},
        {"VALUES_SECTION_SIZE", VALUES_SECTION_SIZE},
    };
    static const struct {
        const char *name;
        long value;
    } states[] = {
        {"IDLE", STATE_IDLE},
        {"TASK_READY", STATE_TASK_READY},
        {"TASK_DONE", STATE_TASK_DONE},
        {"SHUTDOWN", STATE_SHUTDOWN},
        {"CONTROL_REQUEST", STATE_CONTROL_REQUEST},
        {"CONTROL_DONE", STATE_CONTROL_DONE},
        {"INIT_READY", STATE_INIT_READY},
        {"INIT_FAILED", STATE_INIT_FAILED},
        {"FRAME_STAGED", STATE_FRAME_STAGED},
        {"TASK_LAUNCHED", STATE_TASK_LAUNCHED},
        {"TASK_FAILED", STATE_TASK_FAILED},
        {"ACTIVATE", STATE_ACTIVATE},
        {"PREPARE_READY", STATE_PREPARE_READY},
    };

    for (size_t i = 0; i < sizeof(consts) / sizeof(consts[0]); i++) {
        if (add_int(m, consts[i].name, consts[i].value) < 0) {
            return -1;
        }
    }
    PyObject *d = PyDict_New();
    if (d == NULL) {
        return -1;
    }
    for (size_t i = 0; i < sizeof(states) / sizeof(states[0]); i++) {
        char name[64];
        PyOS_snprintf(name, sizeof(name), "STATE_%s", states[i].name);
        PyObject *v = PyLong_FromLong(states[i].value);
        if (v == NULL || PyDict_SetItemString(d, states[i].name, v) < 0 ||
            PyModule_AddObjectRef(m, name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObjectRef(m, "STATES", d) < 0) {
        Py_DECREF(d);
        return -1;
    }
    Py_DECREF(d);
    return 0;
}

static PyModuleDef_Slot mailbox_slots[] = {
    {Py_mod_exec, (void *)mailbox_exec},
    {0, NULL},
};

static struct PyModuleDef mailbox_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "simpler_daemon.mailbox._mailbox",
    .m_doc = "Shared-memory mailbox offsets, atomics, futex park/wake and bulk task "
             "publication helpers.",
    .m_size = 0,
    .m_methods = mailbox_methods,
    .m_slots = mailbox_slots,
};

PyMODINIT_FUNC
PyInit__mailbox(void)
{
    return PyModuleDef_Init(&mailbox_module);
}
