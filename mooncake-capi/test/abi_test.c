/*
 * Pins the struct layouts and constants of transfer_engine_c.h to the
 * numbers of the real library on LP64 targets (x86-64, aarch64). The Go
 * binding mirrors the same numbers in its layout tests.
 */
#include <stddef.h>
#include <stdio.h>

#include "../include/transfer_engine_c.h"

_Static_assert(sizeof(void *) == 8, "the bridge supports LP64 targets only");

_Static_assert(sizeof(struct transfer_request) == 40, "transfer_request size");
_Static_assert(offsetof(struct transfer_request, opcode) == 0, "opcode");
_Static_assert(offsetof(struct transfer_request, source) == 8, "source");
_Static_assert(offsetof(struct transfer_request, target_id) == 16, "target_id");
_Static_assert(offsetof(struct transfer_request, reserved) == 20, "reserved");
_Static_assert(offsetof(struct transfer_request, target_offset) == 24,
               "target_offset");
_Static_assert(offsetof(struct transfer_request, length) == 32, "length");

_Static_assert(sizeof(struct transfer_status) == 16, "transfer_status size");
_Static_assert(offsetof(struct transfer_status, status) == 0, "status");
_Static_assert(offsetof(struct transfer_status, transferred_bytes) == 8,
               "transferred_bytes");

_Static_assert(sizeof(struct buffer_entry) == 16, "buffer_entry size");
_Static_assert(offsetof(struct buffer_entry, length) == 8, "length");

_Static_assert(sizeof(struct notify_msg) == 16, "notify_msg size");
_Static_assert(offsetof(struct notify_msg, msg) == 8, "msg");

_Static_assert(sizeof(struct nic_load_stat) == 80, "nic_load_stat size");
_Static_assert(offsetof(struct nic_load_stat, inflight_bytes) == 64,
               "inflight_bytes");
_Static_assert(offsetof(struct nic_load_stat, ewma_bandwidth_bps) == 72,
               "ewma_bandwidth_bps");

_Static_assert(sizeof(segment_id_t) == 4 && sizeof(batch_id_t) == 8,
               "handle widths");
_Static_assert(OPCODE_READ == 0 && OPCODE_WRITE == 1, "opcodes");
_Static_assert(STATUS_WAITING == 0 && STATUS_PENDING == 1 &&
                   STATUS_INVALID == 2 && STATUS_CANCELED == 3 &&
                   STATUS_COMPLETED == 4 && STATUS_TIMEOUT == 5 &&
                   STATUS_FAILED == 6,
               "task states");
_Static_assert(TE_INVALID_ARGUMENT == 1 && TE_TOO_MANY_REQUESTS == 2 &&
                   TE_ADDRESS_NOT_REGISTERED == 3 && TE_BATCH_BUSY == 4 &&
                   TE_DEVICE_NOT_FOUND == 6 && TE_ADDRESS_OVERLAPPED == 7 &&
                   TE_NOT_SUPPORTED_TRANSPORT == 8 && TE_METADATA == 200 &&
                   TE_NOT_IMPLEMENTED == 999 && TE_ERR_NOT_IMPLEMENTED == -303,
               "result codes");
_Static_assert(INVALID_BATCH == UINT64_MAX && LOCAL_SEGMENT == 0,
               "special handles");

int main(void) {
    /* Checked again at run time, so that a binary built against an older
     * header fails when ctest runs it. */
    struct transfer_request r = {0};
    if ((char *)&r.length - (char *)&r != 32) return 1;
    printf("abi_test: transfer_request %zu, transfer_status %zu bytes: ok\n",
           sizeof(struct transfer_request), sizeof(struct transfer_status));
    return 0;
}
