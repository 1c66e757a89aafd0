/*
 * simpler_daemon.mailbox._mailbox: the cyclic collector's view of the run model.
 *
 * A queued task's record (a TaskSlot) lives exactly as long as its run, which
 * holds it: while the run is in flight the collector gains nothing by tracking
 * it, yet every 700 of them start a pass and a 20,000-task run promotes them
 * all to the oldest generation, whose full pass then walks the whole heap.
 * gc_untrack takes one record out of the collector's lists; gc_track_all puts
 * a run's records back when the run ends, so that the cycles they are part of
 * (slot -> run -> slots) are found again once the run is dropped. An untracked
 * object is still freed by reference counting; only a cycle through it would
 * be missed, which is why the run puts them back before anything can drop it.
 */

#include "_mailbox.h"

PyObject *
mb_gc_untrack(PyObject *Py_UNUSED(m), PyObject *obj)
{
    if (PyObject_IS_GC(obj) && PyObject_GC_IsTracked(obj)) {
        PyObject_GC_UnTrack(obj);
    }
    Py_RETURN_NONE;
}

PyObject *
mb_gc_track_all(PyObject *Py_UNUSED(m), PyObject *seq)
{
    if (!PyList_CheckExact(seq)) {
        PyErr_Format(PyExc_TypeError, "gc_track_all() takes a list, not %.100s",
                     Py_TYPE(seq)->tp_name);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(seq); i++) {
        PyObject *obj = PyList_GET_ITEM(seq, i);
        /* Only objects whose type supports the collector and that are not on its
         * lists already (tracking one twice is a fatal error). */
        if (PyObject_IS_GC(obj) && !PyObject_GC_IsTracked(obj)) {
            PyObject_GC_Track(obj);
        }
    }
    Py_RETURN_NONE;
}
