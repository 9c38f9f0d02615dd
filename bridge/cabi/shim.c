// The C side of the ABI lives in csrc/; cgo compiles it from here so that
// it lands in the same archive as the Go exports it calls.
#include "../../csrc/mcbridge.c"
