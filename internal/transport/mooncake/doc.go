// Package mooncake binds Mooncake Transfer Engine's C API (or the mock TE,
// which implements the same ABI) through purego and implements
// transport.Transport on top of it.
//
// The library is opened at run time from a path (Config.Library, or the
// MCB_MOONCAKE_LIB environment variable), never linked: the real
// libtransfer_engine.so is a C++ build that most hosts do not have. Before it
// is opened, the file and its DT_NEEDED closure are inspected, and a library
// that would bring a second Go runtime into the process (a USE_ETCD build
// links libetcd_wrapper.so, a Go c-shared library) is refused.
//
// The binding hides the C API's hazards from the host process: batch ids are
// raw pointers, so a Batch frees its id exactly once and never passes it again
// after that; metadata strings the library cannot serve are refused before
// the library sees them (the real engine aborts the process on them);
// enableGracefulShutdown, which installs process-wide signal handlers, is
// never called. Both of the library's error conventions (positive Status codes
// and negative int codes) become bridge status codes.
//
// Only linux/amd64 and linux/arm64 are supported: the layouts mirrored here
// are those of LP64 Linux.
package mooncake
