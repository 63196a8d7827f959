/* tiles.c: codes from the row layout into the tiled one (kt.h, KT_LAYOUT_TILES),
 * done once when a model loads. One task per tile of KT_TILE_ROWS rows: its
 * 64-byte chunks are copied in the tiled order, chunk c of row i to position
 * c * 4 + i of the tile. */
#include <string.h>
#include "kt_internal.h"

#define TILES_PER_TASK 64

struct tile_job {
    uint8_t *dst;
    const uint8_t *src;
    int64_t rows;
    int64_t row_bytes;
};

static void tile_task(void *ctx, int64_t task, int thread)
{
    (void)thread;
    const struct tile_job *job = ctx;
    int64_t tile_bytes = KT_TILE_ROWS * job->row_bytes, chunks = job->row_bytes / KT_TILE_CHUNK;
    int64_t n_tiles = job->rows / KT_TILE_ROWS;
    for (int64_t t = task * TILES_PER_TASK; t < n_tiles && t < (task + 1) * TILES_PER_TASK; t++) {
        const uint8_t *from = job->src + t * tile_bytes;
        uint8_t *to = job->dst + t * tile_bytes;
        for (int64_t c = 0; c < chunks; c++)
            for (int i = 0; i < KT_TILE_ROWS; i++)
                memcpy(to + (c * KT_TILE_ROWS + i) * KT_TILE_CHUNK, from + i * job->row_bytes + c * KT_TILE_CHUNK,
                       KT_TILE_CHUNK);
    }
}

int kt_tile_codes(kt_pool *pool, void *dst, const void *src, int64_t rows, int64_t row_bytes)
{
    if (!dst || !src || rows < 1 || row_bytes < 1 || rows % KT_TILE_ROWS != 0 || row_bytes % KT_TILE_CHUNK != 0)
        return KT_EINVAL;
    if (row_bytes > INT64_MAX / rows)
        return KT_EINVAL;
    struct tile_job job = {dst, src, rows, row_bytes};
    int64_t n_tasks = (rows / KT_TILE_ROWS + TILES_PER_TASK - 1) / TILES_PER_TASK;
    if (pool && n_tasks > 1) {
        kt_pool_run(pool, tile_task, &job, n_tasks);
        return KT_OK;
    }
    for (int64_t t = 0; t < n_tasks; t++)
        tile_task(&job, t, 0);
    return KT_OK;
}
