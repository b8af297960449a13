/*
 * meshnode residual capture: a ggml scheduler eval callback in C.
 *
 * Layer 1 of the executor's three native layers (bindings -> owning wrapper ->
 * executor API; see native/README.md). llama.cpp offers no "run layers [a, b)"
 * entry point, so a non-tail range asks the scheduler, through
 * llama_context_params.cb_eval, for the tensor named "l_out-{n_layer-1}" (the
 * residual after its last layer), copies it out, and returns false: the
 * scheduler then stops the split, so output_norm and the lm_head are never
 * computed. A tail installs no callback at all.
 *
 * The callback runs ~470 times per decode step (once per graph node with
 * ask=true), so it is C, not a Python ctypes callback (~0.5 ms per step).
 *
 * It can also *restore* one tensor: a graph that scales whatever input it
 * gets (gemma2: inp_scaled = inp * sqrtf(n_embd), for embeddings input too)
 * would scale a non-head hop's residual a second time. The callback asks for
 * that tensor (e.g. "inp_scaled"), and once it is computed overwrites it with
 * the hop's input rows, exactly as they came, then lets the graph go on: the
 * layers read what they read inside the whole model.
 *
 * It links against nothing: the three ggml functions it needs are passed in
 * as pointers resolved from llama-cpp-python's own libggml-base.so, so this
 * file cannot drift from the ggml build that the process actually runs.
 *
 * Compiled as a Python extension only to ride setuptools' build; it has no
 * PyInit and is loaded with ctypes.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct ggml_tensor; /* opaque: only touched through the ggml functions below */

typedef const char *(*mn_get_name_fn)(const struct ggml_tensor *);
typedef size_t (*mn_nbytes_fn)(const struct ggml_tensor *);
typedef void (*mn_tensor_get_fn)(const struct ggml_tensor *, void *, size_t, size_t);
typedef void (*mn_tensor_set_fn)(struct ggml_tensor *, const void *, size_t, size_t);

/* Mirrors meshnode.executor._bindings.CaptureState field for field. */
typedef struct mn_capture {
    mn_get_name_fn get_name;     /* ggml_get_name */
    mn_nbytes_fn nbytes;         /* ggml_nbytes */
    mn_tensor_get_fn tensor_get; /* ggml_backend_tensor_get */
    char target[64];             /* tensor name to capture, e.g. "l_out-14" */
    void *dst;                   /* destination buffer (float32 rows) */
    size_t capacity;             /* bytes available at dst */
    size_t written;              /* bytes written so far (one capture per ubatch) */
    int32_t hits;                /* number of captures made */
    int32_t overflow;            /* 1 if a capture did not fit: caller must fail the step */
    int32_t stop;                /* 1: stop the graph after capturing (a non-tail range) */
    mn_tensor_set_fn tensor_set; /* ggml_backend_tensor_set */
    char restore[64];            /* tensor name to overwrite with src, "" for none */
    const void *src;             /* the input rows (float32), read in ubatch order */
    size_t src_size;             /* bytes at src */
    size_t src_read;             /* bytes restored so far */
    int32_t restores;            /* number of restores made */
} mn_capture;

static bool mn_restore(mn_capture *c, struct ggml_tensor *t) {
    size_t n = c->nbytes(t);
    if (c->src_read + n > c->src_size) {
        c->overflow = 1;
        return false;
    }
    c->tensor_set(t, (const char *)c->src + c->src_read, 0, n);
    c->src_read += n;
    c->restores += 1;
    return true;
}

/* ggml_backend_sched_eval_callback: bool (*)(struct ggml_tensor *, bool ask, void *). */
bool mn_capture_eval(struct ggml_tensor *t, bool ask, void *user_data) {
    mn_capture *c = (mn_capture *)user_data;
    const char *name = c->get_name(t);
    if (c->restore[0] != '\0' && strncmp(name, c->restore, sizeof c->restore) == 0) {
        return ask ? true : mn_restore(c, t);
    }
    if (c->target[0] == '\0' || strncmp(name, c->target, sizeof c->target) != 0) {
        /* ask: "not needed"; observe (cannot happen for unneeded nodes): go on. */
        return !ask;
    }
    if (ask) {
        return true;
    }
    size_t n = c->nbytes(t);
    if (c->written + n > c->capacity) {
        c->overflow = 1;
        return false;
    }
    c->tensor_get(t, (char *)c->dst + c->written, 0, n);
    c->written += n;
    c->hits += 1;
    return !c->stop; /* stop this split: skip output_norm and the lm_head */
}
