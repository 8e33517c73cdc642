/* MEMO's planned allocator (section 4.2, runtime side): a device allocator that replays the
 * planner's offsets for the requests of a training iteration and serves everything else from a
 * small caching allocator of its own.
 *
 * Loaded by torch as a CUDAPluggableAllocator (arena_malloc / arena_free), it replaces the caching
 * allocator for the whole process, so it must be safe for every request:
 *   - The plan is one iteration's requests in order, each with its address in the arena (the
 *     bi-level plan composed: a window's base from level 2 plus the in-window offset from level 1;
 *     a tensor that outlives its window at its level-2 offset) or -1 (served by the cache: it
 *     outlives the iteration), and the window marks ("begin fwd L3", ...) with the request index at
 *     which each fell.
 *   - Inside an iteration (arena_iteration), the k-th request is checked against the plan's k-th
 *     entry: no larger and an arena offset -> that address (smaller: a shorter micro-batch or
 *     Seq1F1B segment than the profiled one, inside the planned range). A larger size, or a planned
 *     range that overlaps a block still alive, stops the replay (counted) and the cache serves what
 *     follows, up to the next window mark: a mark puts the replay back at the request index the
 *     plan recorded for it. A divergence costs memory until the next mark, never correctness.
 *   - Only requests on the iteration's stream are replayed at the plan's offsets; requests from
 *     other streams keep their place in the sequence and go to the cache.
 *   - Streams, as torch's caching allocator keeps them: a freed block is reused at once by its own
 *     stream (stream order makes that safe) and never by another. A block some other stream used
 *     (arena_record_stream) stays reserved after its free until an event recorded on each of
 *     those streams at the free has completed; an arena block in that state refuses the plan's
 *     reuse of its range (counted as an overlap refusal). When the backend is out of memory, the
 *     allocator synchronizes the device, reclaims every pending and cached block and retries once
 *     (counted as a retry); if that fails too, a CUDA run ends with one line on stderr (torch's
 *     pluggable allocator would take the NULL for a tensor). The device is synchronized only
 *     there, when the arena is reserved over a non-empty cache, and at an iteration's end when some
 *     block waits for another stream (counted).
 *   - Every entry point binds the device's primary context to the calling thread if it has none:
 *     the driver API needs one, and autograd's device thread may allocate before its first runtime
 *     call would have bound it.
 *   - With recording on, every malloc, free and mark is appended to an event log: on a GPU this is
 *     the job profiler's trace, windows included.
 *
 * The backend is libcuda's cuMemAlloc/cuMemFree/cuCtxSynchronize, opened at run time (no CUDA
 * headers needed to build), or the C heap with an optional capacity: the same code, testable on
 * a machine without a GPU.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#define ROUND 512 /* cache granularity: every cached block is a multiple of it */

#define MAX_USERS 8 /* other streams one block may be recorded on */

typedef struct {
    char *ptr;
    int64_t size;  /* cache: rounded */
    void *stream;  /* the stream it was allocated on */
    int n_users;   /* live: other streams recorded on it; pending: events still to complete */
    void *users[MAX_USERS];
} Block;

typedef struct {
    Block *items;
    int64_t n, cap;
} Blocks;

typedef struct {
    int kind; /* 0 malloc, 1 free, 2 mark */
    int64_t a, b; /* malloc/free: address, bytes; mark: its id, 0 */
} Event;

/* torch calls the allocator from the main thread and from autograd's device thread: every entry
 * point holds this lock (none calls another entry point). */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
#define LOCK pthread_mutex_lock(&lock)
#define UNLOCK pthread_mutex_unlock(&lock)

/* ---- state ---------------------------------------------------------------------------------- */
static int backend_cuda = 0;
static int64_t heap_capacity = -1;  /* C heap backend: bytes it may hand out (-1: no limit) */
static int64_t backend_bytes = 0;   /* held from the backend, arena included */
static void *cuda_lib = NULL;
static int (*cu_alloc)(uint64_t *, size_t) = NULL;
static int (*cu_free)(uint64_t) = NULL;
static int (*cu_sync)(void) = NULL;
static int (*cu_event_create)(void **, unsigned) = NULL;
static int (*cu_event_record)(void *, void *) = NULL;
static int (*cu_event_query)(void *) = NULL;
static int (*cu_event_destroy)(void *) = NULL;
static int (*cu_ctx_get_current)(void **) = NULL;
static int (*cu_ctx_set_current)(void *) = NULL;
static int (*cu_device_get)(int *, int) = NULL;
static int (*cu_primary_ctx_retain)(void **, int) = NULL;
static int fatal_oom = 0; /* a failed allocation aborts (torch's pluggable allocator cannot take NULL) */

static Blocks cached = {0}, pending = {0}, live_cached = {0}, pending_arena = {0};

static char *arena = NULL;
static int64_t arena_bytes = 0;
static Blocks live_arena = {0}; /* ptr/size of arena blocks handed out and not yet freed */

/* the plan: the iteration's requests (bytes, arena offset or -1) and its marks (id, request index) */
static int64_t plan_n = 0, *plan_sizes = NULL, *plan_offsets = NULL;
static int64_t plan_marks = 0, *mark_ids = NULL, *mark_at = NULL;

static int replaying = 0;          /* inside an iteration, with a plan and an arena */
static void *replay_stream = NULL; /* the stream whose requests the plan replays */
static int64_t position = 0;       /* the next request's index in the plan */
static int64_t next_mark = 0;      /* the next mark expected */
static int diverged = 0;

static int recording = 0;
static Event *events = NULL;
static int64_t n_events = 0, events_cap = 0;

/* counters, read by arena_stats in this order */
enum {
    S_PLANNED, S_PLANNED_BYTES, S_CACHED_ALLOCS, S_CACHE_HITS, S_DIVERGENCES, S_OVERLAPS,
    S_RETRIES, S_FAILED, S_BACKEND_BYTES, S_ALLOCATED, S_PEAK_ALLOCATED, S_CACHED_FREE, S_PENDING,
    S_MARKS_MATCHED, S_PEAK_BACKEND_BYTES, S_SYNCS, S_COUNT
};
static int64_t stats[S_COUNT];

/* ---- small helpers ------------------------------------------------------------------------- */
static int push(Blocks *bs, Block b) {
    if (bs->n == bs->cap) {
        int64_t cap = bs->cap ? 2 * bs->cap : 64;
        Block *items = realloc(bs->items, cap * sizeof(Block));
        if (!items) return -1;
        bs->items = items;
        bs->cap = cap;
    }
    bs->items[bs->n++] = b;
    return 0;
}

static Block take_at(Blocks *bs, int64_t i) {
    Block b = bs->items[i];
    bs->items[i] = bs->items[--bs->n];
    return b;
}

static int64_t find_ptr(const Blocks *bs, const char *ptr) {
    for (int64_t i = 0; i < bs->n; i++)
        if (bs->items[i].ptr == ptr) return i;
    return -1;
}

static int64_t sum_sizes(const Blocks *bs) {
    int64_t total = 0;
    for (int64_t i = 0; i < bs->n; i++) total += bs->items[i].size;
    return total;
}

static void record(int kind, int64_t a, int64_t b) {
    if (!recording) return;
    if (n_events == events_cap) {
        int64_t cap = events_cap ? 2 * events_cap : 4096;
        Event *e = realloc(events, cap * sizeof(Event));
        if (!e) { recording = 0; return; }
        events = e;
        events_cap = cap;
    }
    events[n_events++] = (Event){kind, a, b};
}

/* ---- backend ------------------------------------------------------------------------------- */
enum { CU_OUT_OF_MEMORY = 2 };
static int last_alloc_error = 0; /* the driver's answer to the last failed allocation */

static char *backend_alloc(int64_t size) {
    char *p;
    if (backend_cuda) {
        uint64_t dptr = 0;
        int rc = cu_alloc(&dptr, (size_t)size);
        if (rc != 0) { last_alloc_error = rc; return NULL; }
        p = (char *)(uintptr_t)dptr;
    } else {
        last_alloc_error = CU_OUT_OF_MEMORY;
        if (heap_capacity >= 0 && backend_bytes + size > heap_capacity) return NULL;
        p = malloc((size_t)size);
        if (!p) return NULL;
    }
    backend_bytes += size;
    if (backend_bytes > stats[S_PEAK_BACKEND_BYTES]) stats[S_PEAK_BACKEND_BYTES] = backend_bytes;
    return p;
}

static void backend_free(char *p, int64_t size) {
    if (backend_cuda) cu_free((uint64_t)(uintptr_t)p);
    else free(p);
    backend_bytes -= size;
}

/* Events. The heap backend has no device: its "streams" are opaque handles, an event is a
 * ticket on one, and a stream has passed its tickets once arena_fake_stream_done says so. */
typedef struct { void *stream; int64_t recorded, done; } FakeStream;
typedef struct { FakeStream *on; int64_t ticket; } FakeEvent;
enum { MAX_FAKE_STREAMS = 64 };
static FakeStream fake_streams[MAX_FAKE_STREAMS];
static int n_fake_streams = 0;

static FakeStream *fake_stream(void *stream) {
    for (int i = 0; i < n_fake_streams; i++)
        if (fake_streams[i].stream == stream) return &fake_streams[i];
    if (n_fake_streams == MAX_FAKE_STREAMS) return NULL;
    fake_streams[n_fake_streams] = (FakeStream){stream, 0, 0};
    return &fake_streams[n_fake_streams++];
}

static void *event_record(void *stream) {
    if (backend_cuda) {
        void *ev = NULL;
        if (cu_event_create(&ev, 2 /* CU_EVENT_DISABLE_TIMING */) != 0) return NULL;
        if (cu_event_record(ev, stream) != 0) { cu_event_destroy(ev); return NULL; }
        return ev;
    }
    FakeStream *on = fake_stream(stream);
    FakeEvent *ev = on ? malloc(sizeof(FakeEvent)) : NULL;
    if (ev) *ev = (FakeEvent){on, ++on->recorded};
    return ev;
}

#define CUDA_ERROR_NOT_READY 600
static void backend_sync(void);

static int event_done(void *ev) {
    if (backend_cuda) {
        int rc = cu_event_query(ev);
        if (rc == CUDA_ERROR_NOT_READY) return 0;
        if (rc != 0) backend_sync(); /* the query itself failed: wait for everything instead */
        return 1;
    }
    FakeEvent *fe = ev;
    return fe->ticket <= fe->on->done;
}

static void event_destroy(void *ev) {
    if (backend_cuda) cu_event_destroy(ev);
    else free(ev);
}

static void backend_sync(void) {
    stats[S_SYNCS]++;
    if (backend_cuda) cu_sync();
    else
        for (int i = 0; i < n_fake_streams; i++) fake_streams[i].done = fake_streams[i].recorded;
}

/* The driver API needs a current context on the calling thread; the runtime binds the primary one
 * lazily at a thread's first runtime call, which autograd's device thread may not have made yet
 * when it first allocates. Bind it here then, as the runtime would. */
static void bind_context(int device) {
    void *ctx = NULL, *primary = NULL;
    int dev = 0;
    if (cu_ctx_get_current(&ctx) == 0 && ctx) return;
    if (cu_device_get(&dev, device) == 0 && cu_primary_ctx_retain(&primary, dev) == 0) cu_ctx_set_current(primary);
}

int arena_init(int use_cuda, int64_t capacity, int abort_on_oom) {
    backend_cuda = use_cuda;
    heap_capacity = capacity;
    fatal_oom = abort_on_oom;
    if (!use_cuda) return 0;
    const char *driver = getenv("MEMO_LIBCUDA"); /* tests: a stand-in driver */
    cuda_lib = dlopen(driver ? driver : "libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cuda_lib) return -1;
    cu_alloc = (int (*)(uint64_t *, size_t))dlsym(cuda_lib, "cuMemAlloc_v2");
    cu_free = (int (*)(uint64_t))dlsym(cuda_lib, "cuMemFree_v2");
    cu_sync = (int (*)(void))dlsym(cuda_lib, "cuCtxSynchronize");
    cu_event_create = (int (*)(void **, unsigned))dlsym(cuda_lib, "cuEventCreate");
    cu_event_record = (int (*)(void *, void *))dlsym(cuda_lib, "cuEventRecord");
    cu_event_query = (int (*)(void *))dlsym(cuda_lib, "cuEventQuery");
    cu_event_destroy = (int (*)(void *))dlsym(cuda_lib, "cuEventDestroy_v2");
    cu_ctx_get_current = (int (*)(void **))dlsym(cuda_lib, "cuCtxGetCurrent");
    cu_ctx_set_current = (int (*)(void *))dlsym(cuda_lib, "cuCtxSetCurrent");
    cu_device_get = (int (*)(int *, int))dlsym(cuda_lib, "cuDeviceGet");
    cu_primary_ctx_retain = (int (*)(void **, int))dlsym(cuda_lib, "cuDevicePrimaryCtxRetain");
    return (cu_alloc && cu_free && cu_sync && cu_event_create && cu_event_record && cu_event_query &&
            cu_event_destroy && cu_ctx_get_current && cu_ctx_set_current && cu_device_get &&
            cu_primary_ctx_retain) ? 0 : -2;
}

/* ---- streams on blocks ------------------------------------------------------------------------ */
/* At a free: an event on every other stream that used the block; 0 when none did. */
static int record_user_events(Block *b) {
    int n = 0;
    for (int i = 0; i < b->n_users; i++) {
        void *ev = event_record(b->users[i]);
        if (!ev) { backend_sync(); for (int j = 0; j < n; j++) event_destroy(b->users[j]); return 0; }
        b->users[n++] = ev;
    }
    b->n_users = n;
    return n;
}

/* Pending: every event done? (then the events are gone and the block is free) */
static int passed(Block *b) {
    for (int i = 0; i < b->n_users; i++)
        if (!event_done(b->users[i])) return 0;
    for (int i = 0; i < b->n_users; i++) event_destroy(b->users[i]);
    b->n_users = 0;
    return 1;
}

static void reclaim_pending(void) {
    for (int64_t i = 0; i < pending.n;) {
        if (passed(&pending.items[i])) push(&cached, take_at(&pending, i));
        else i++;
    }
    for (int64_t i = 0; i < pending_arena.n;) {
        if (passed(&pending_arena.items[i])) take_at(&pending_arena, i);
        else i++;
    }
}

/* ---- the cache ----------------------------------------------------------------------------- */
static void release_cached(void) {
    for (int64_t i = 0; i < cached.n; i++) backend_free(cached.items[i].ptr, cached.items[i].size);
    cached.n = 0;
}

static int64_t best_cached(int64_t rounded, void *stream) {
    int64_t best = -1;
    /* best fit among this stream's blocks no more than 25% larger: a cached block is never split */
    for (int64_t i = 0; i < cached.n; i++) {
        int64_t s = cached.items[i].size;
        if (cached.items[i].stream == stream && s >= rounded && s <= rounded + rounded / 4 &&
            (best < 0 || s < cached.items[best].size))
            best = i;
    }
    return best;
}

static char *cache_alloc(int64_t size, void *stream) {
    int64_t rounded = (size + ROUND - 1) / ROUND * ROUND;
    if (rounded == 0) rounded = ROUND;
    reclaim_pending();
    int64_t best = best_cached(rounded, stream);
    Block b;
    if (best >= 0) {
        b = take_at(&cached, best);
        stats[S_CACHE_HITS]++;
    } else {
        char *p = backend_alloc(rounded);
        if (!p) { /* out of memory: wait for every stream, take back everything cached, retry */
            stats[S_RETRIES]++;
            backend_sync();
            reclaim_pending();
            release_cached();
            p = backend_alloc(rounded);
            if (!p) { stats[S_FAILED]++; return NULL; }
        }
        b = (Block){p, rounded, stream, 0, {0}};
    }
    b.stream = stream;
    b.n_users = 0;
    push(&live_cached, b);
    stats[S_CACHED_ALLOCS]++;
    return b.ptr;
}

/* ---- the arena ----------------------------------------------------------------------------- */
static int overlaps(const Blocks *bs, const char *p, int64_t size) {
    for (int64_t i = 0; i < bs->n; i++) {
        const Block *b = &bs->items[i];
        if (p < b->ptr + b->size && b->ptr < p + size) return 1;
    }
    return 0;
}

static void diverge(void) {
    if (!diverged) stats[S_DIVERGENCES]++;
    diverged = 1;
}

static char *planned_alloc(int64_t size, void *stream) {
    if (diverged || position >= plan_n || size > plan_sizes[position]) {
        diverge();
        return NULL;
    }
    int64_t offset = plan_offsets[position++];
    if (offset < 0 || stream != replay_stream) return NULL; /* outlives the iteration, or another stream's */
    char *p = arena + offset;
    reclaim_pending();
    if (offset + size > arena_bytes || overlaps(&live_arena, p, size) || overlaps(&pending_arena, p, size)) {
        stats[S_OVERLAPS]++;
        diverge();
        return NULL;
    }
    push(&live_arena, (Block){p, size, stream, 0, {0}});
    stats[S_PLANNED]++;
    stats[S_PLANNED_BYTES] += size;
    return p;
}

static int reserve(int64_t bytes) {
    if (live_arena.n || pending_arena.n) return -1; /* blocks still in use in the old arena */
    /* what the profiling iterations left cached would sit beside the arena for the whole run */
    if (pending.n || cached.n) backend_sync(); /* a cached block's last reader may still be queued */
    reclaim_pending();
    release_cached();
    if (arena) backend_free(arena, arena_bytes);
    arena = NULL;
    arena_bytes = 0;
    if (bytes <= 0) return 0;
    arena = backend_alloc(bytes);
    if (!arena) return -2;
    arena_bytes = bytes;
    return 0;
}

int arena_reserve(int64_t bytes) {
    LOCK;
    int rc = reserve(bytes);
    UNLOCK;
    return rc;
}

static int64_t *copy_of(const int64_t *values, int64_t n) {
    int64_t *out = malloc((n ? n : 1) * sizeof(int64_t));
    if (out) memcpy(out, values, n * sizeof(int64_t));
    return out;
}

static void drop_plan(void) {
    free(plan_sizes);
    free(plan_offsets);
    free(mark_ids);
    free(mark_at);
    plan_sizes = plan_offsets = mark_ids = mark_at = NULL;
    plan_n = plan_marks = 0;
    replaying = 0;
}

static int set_plan(int64_t n, const int64_t *sizes, const int64_t *offsets, int64_t m, const int64_t *ids,
                    const int64_t *at) {
    drop_plan();
    plan_sizes = copy_of(sizes, n);
    plan_offsets = copy_of(offsets, n);
    mark_ids = copy_of(ids, m);
    mark_at = copy_of(at, m);
    if (!plan_sizes || !plan_offsets || !mark_ids || !mark_at) { drop_plan(); return -2; }
    plan_n = n;
    plan_marks = m;
    return 0;
}

int arena_set_plan(int64_t n, const int64_t *sizes, const int64_t *offsets, int64_t m, const int64_t *ids,
                   const int64_t *at) {
    LOCK;
    int rc = set_plan(n, sizes, offsets, m, ids, at);
    UNLOCK;
    return rc;
}

/* An iteration begins (on != 0: its requests on `stream` are replayed from the plan's first) or ends. */
void arena_iteration(int on, void *stream) {
    LOCK;
    replaying = on && arena && plan_n;
    replay_stream = stream;
    position = next_mark = 0;
    diverged = 0;
    UNLOCK;
}

/* A window mark: the replay goes on from the request index the plan recorded for the next mark
 * with this id (marks the run skipped are passed over); none left: the replay stops. */
void arena_mark(int id) {
    LOCK;
    record(2, id, 0);
    if (replaying) {
        int64_t j = next_mark;
        while (j < plan_marks && mark_ids[j] != id) j++;
        if (j < plan_marks) {
            position = mark_at[j];
            next_mark = j + 1;
            diverged = 0;
            stats[S_MARKS_MATCHED]++;
        } else {
            diverge();
        }
    }
    UNLOCK;
}

/* ---- the pluggable allocator's entry points -------------------------------------------------- */
static void out_of_memory(ssize_t size) {
    /* any other driver error (an earlier kernel's illegal address, a lost context) is named as
       such: calling it out of memory would hide the fault behind it */
    if (last_alloc_error != CU_OUT_OF_MEMORY)
        fprintf(stderr, "MEMO planned allocator: the driver refused %zd bytes with CUDA error %d, not out of "
                "memory (a kernel's fault or a lost context); aborting\n", size, last_alloc_error);
    else
        fprintf(stderr, "MEMO planned allocator: out of device memory for %zd bytes (held %lld, allocated %lld, "
                "arena %lld); aborting, as torch's pluggable allocator cannot take a failed allocation\n",
                size, (long long)backend_bytes, (long long)stats[S_ALLOCATED], (long long)arena_bytes);
    abort();
}

void *arena_malloc(ssize_t size, int device, void *stream) {
    LOCK;
    if (backend_cuda) bind_context(device);
    /* torch's pluggable allocator asks for 0 bytes too (empty tensors), which its caching allocator
       never sees: they are no request of any plan, whoever recorded it (the CUDA history, the CPU
       tracer, this arena), nor recorded. torch keys its blocks by address, so each takes the
       cache's 512 bytes of its own rather than a place a live block may start at. */
    int empty = size == 0;
    char *p = replaying && !empty ? planned_alloc(size, stream) : NULL;
    if (!p) p = cache_alloc(size, stream);
    if (!p && fatal_oom) out_of_memory(size);
    if (p) {
        stats[S_ALLOCATED] += size;
        if (stats[S_ALLOCATED] > stats[S_PEAK_ALLOCATED]) stats[S_PEAK_ALLOCATED] = stats[S_ALLOCATED];
        if (!empty) record(0, (int64_t)(uintptr_t)p, size);
    }
    UNLOCK;
    return p;
}

void arena_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)stream;
    char *p = ptr;
    if (!p) return;
    LOCK;
    if (backend_cuda) bind_context(device); /* events may be recorded */
    if (size) record(1, (int64_t)(uintptr_t)p, size);
    stats[S_ALLOCATED] -= size;
    int64_t i = find_ptr(&live_arena, p);
    if (i >= 0) { /* the arena's memory is the plan's: reserved only while other streams use it */
        Block b = take_at(&live_arena, i);
        if (record_user_events(&b)) push(&pending_arena, b);
    } else if ((i = find_ptr(&live_cached, p)) >= 0) {
        Block b = take_at(&live_cached, i);
        push(record_user_events(&b) ? &pending : &cached, b);
    } /* else: never handed out by us; ignored rather than corrupt the cache */
    UNLOCK;
}

/* Another stream uses this live block (torch's record_stream): its free waits for that stream.
 * Returns 0, or -1 for a block not handed out by us or one with too many streams. */
int arena_record_stream(void *ptr, void *stream) {
    LOCK;
    int64_t i = find_ptr(&live_cached, ptr);
    Block *b = i >= 0 ? &live_cached.items[i] : NULL;
    if (!b && (i = find_ptr(&live_arena, ptr)) >= 0) b = &live_arena.items[i];
    int rc = b ? 0 : -1;
    if (b && stream != b->stream) {
        int known = 0;
        for (int k = 0; k < b->n_users; k++) known |= b->users[k] == stream;
        if (!known && b->n_users == MAX_USERS) rc = -1;
        else if (!known) b->users[b->n_users++] = stream;
    }
    UNLOCK;
    return rc;
}

/* Heap backend: `stream` has run everything recorded on it so far. */
void arena_fake_stream_done(void *stream) {
    LOCK;
    FakeStream *on = fake_stream(stream);
    if (on) on->done = on->recorded;
    UNLOCK;
}

/* ---- introspection --------------------------------------------------------------------------- */
int64_t arena_stat_count(void) { return S_COUNT; }

void arena_stats(int64_t *out) {
    LOCK;
    stats[S_BACKEND_BYTES] = backend_bytes;
    stats[S_CACHED_FREE] = sum_sizes(&cached);
    stats[S_PENDING] = sum_sizes(&pending);
    memcpy(out, stats, sizeof(stats));
    UNLOCK;
}

/* The peaks start again from now and the retry and failure counts from zero, as torch's
   reset_peak_memory_stats + reset_accumulated_memory_stats do for the caching allocator: both
   allocators' numbers then cover the same iterations. */
void arena_reset_peak(void) {
    LOCK;
    stats[S_PEAK_ALLOCATED] = stats[S_ALLOCATED];
    stats[S_PEAK_BACKEND_BYTES] = backend_bytes;
    stats[S_RETRIES] = 0;
    stats[S_FAILED] = 0;
    UNLOCK;
}

int64_t arena_base(void) { return (int64_t)(uintptr_t)arena; }

int64_t arena_size(void) { return arena_bytes; }

void arena_record(int on) {
    LOCK;
    recording = on;
    if (on) n_events = 0;
    UNLOCK;
}

int64_t arena_events(int64_t *out, int64_t max_events) {
    /* out: kind, a, b per event; returns the number of events (copies at most max_events) */
    LOCK;
    int64_t n = n_events < max_events ? n_events : max_events;
    for (int64_t i = 0; i < n; i++) {
        out[3 * i] = events[i].kind;
        out[3 * i + 1] = events[i].a;
        out[3 * i + 2] = events[i].b;
    }
    int64_t total = n_events;
    UNLOCK;
    return total;
}

/* An iteration's end: every block still waiting for another stream may be reused once the streams
 * have passed; the device is synchronized only when some block waits. */
void arena_settle(void) {
    LOCK;
    if (pending.n || pending_arena.n) backend_sync();
    reclaim_pending();
    UNLOCK;
}

/* Forget everything: the plan, counters, the trace, and every block, also those still handed
 * out (their owners must be gone: for tests and for a process that has finished with the GPU). */
void arena_reset(void) {
    LOCK;
    backend_sync();
    reclaim_pending();
    for (int64_t i = 0; i < live_cached.n; i++) push(&cached, live_cached.items[i]);
    live_cached.n = 0;
    release_cached();
    live_arena.n = 0;
    if (arena) backend_free(arena, arena_bytes);
    arena = NULL;
    arena_bytes = 0;
    drop_plan();
    pending_arena.n = 0;
    n_fake_streams = 0;
    recording = 0;
    n_events = 0;
    memset(stats, 0, sizeof(stats));
    UNLOCK;
}

/* Give every cached block back to the backend (all streams synchronized first). */
void arena_empty_cache(void) {
    LOCK;
    backend_sync();
    reclaim_pending();
    release_cached();
    UNLOCK;
}
