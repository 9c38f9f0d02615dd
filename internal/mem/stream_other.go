//go:build !amd64

package mem

const streamStores = false

func streamCopy(dst, src *byte, n uintptr) { panic("mem: no streaming stores on this platform") }
