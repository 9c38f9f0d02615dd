//go:build linux && (amd64 || arm64)

package mooncake

import (
	"debug/buildinfo"
	"debug/elf"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/mcbridge/mcbridge/internal/status"
)

// goWrapperNames are Go c-shared libraries that Mooncake builds link when
// their etcd or Kubernetes-lease backends are on. They are refused by name
// even when the file itself cannot be found.
var goWrapperNames = []string{"libetcd_wrapper", "libk8s_lease_wrapper"}

// goSections and goSymbols mark a file built by the Go linker. Any one of
// them is enough: strip removes .symtab but not the allocated Go sections,
// and a c-shared library always exports the cgo entry points.
var (
	goSections = []string{".go.buildinfo", ".gopclntab", ".note.go.buildid"}
	goSymbols  = []string{"_cgo_init", "x_cgo_init", "crosscall2", "_cgo_panic", "_cgo_topofstack"}
)

// maxClosure bounds how many libraries the DT_NEEDED walk opens.
const maxClosure = 512

// elfInfo is what the load check needs from one ELF file.
type elfInfo struct {
	machine   elf.Machine
	class     elf.Class
	needed    []string
	rpath     []string
	runpath   []string
	goRuntime string // why the file looks like Go output; "" when it does not
}

// inspectELF reads r as an ELF shared object. A file that debug/elf cannot
// parse, or makes panic, is an error: it will not be loaded.
func inspectELF(r io.ReaderAt) (info elfInfo, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("malformed ELF file: %v", p)
		}
	}()
	f, err := elf.NewFile(r)
	if err != nil {
		return info, err
	}
	info.machine, info.class = f.Machine, f.Class
	if info.needed, err = f.ImportedLibraries(); err != nil {
		return info, err
	}
	for _, tag := range []struct {
		tag elf.DynTag
		dst *[]string
	}{{elf.DT_RPATH, &info.rpath}, {elf.DT_RUNPATH, &info.runpath}} {
		vals, err := f.DynString(tag.tag)
		if err != nil {
			return info, err
		}
		for _, v := range vals {
			*tag.dst = append(*tag.dst, filepath.SplitList(v)...)
		}
	}
	info.goRuntime = goMarker(f, r)
	return info, nil
}

func goMarker(f *elf.File, r io.ReaderAt) string {
	for _, name := range goSections {
		if f.Section(name) != nil {
			return "section " + name
		}
	}
	// A missing dynamic symbol table is not an error: static-looking objects
	// have none, and they cannot export cgo entry points either.
	if syms, err := f.DynamicSymbols(); err == nil {
		for _, s := range syms {
			if s.Section == elf.SHN_UNDEF {
				continue
			}
			for _, g := range goSymbols {
				if s.Name == g {
					return "exported symbol " + g
				}
			}
		}
	}
	// Catches files whose section headers were stripped away entirely.
	if _, err := buildinfo.Read(r); err == nil {
		return "Go build information"
	}
	return ""
}

// hostMachine is the ELF machine of this process.
func hostMachine() elf.Machine {
	if runtime.GOARCH == "arm64" {
		return elf.EM_AARCH64
	}
	return elf.EM_X86_64
}

func inspectFile(path string) (elfInfo, error) {
	f, err := os.Open(path)
	if err != nil {
		return elfInfo{}, err
	}
	defer f.Close()
	return inspectELF(f)
}

// compatible reports whether path is an ELF object this process could load;
// the dynamic loader skips incompatible candidates in the same way.
func compatible(path string) bool {
	info, err := inspectFile(path)
	return err == nil && info.class == elf.ELFCLASS64 && info.machine == hostMachine()
}

// checkSingleGoRuntime refuses a library that is, or depends on, a Go
// c-shared object: loading it would start a second Go runtime in this
// process, which Go does not support. It walks the DT_NEEDED closure the way
// the dynamic loader would find it, and returns the closure's sonames.
func checkSingleGoRuntime(path string) ([]string, error) {
	root, err := inspectFile(path)
	if err != nil {
		return nil, status.Wrap(status.Config, err, "Transfer Engine library "+path)
	}
	if root.class != elf.ELFCLASS64 || root.machine != hostMachine() {
		return nil, status.Errorf(status.Config, "Transfer Engine library %s is built for %v/%v, not this process", path, root.class, root.machine)
	}
	type item struct {
		path, neededBy string
		info           elfInfo
	}
	queue := []item{{path: path, info: root}}
	seen := map[string]bool{path: true}
	var names []string
	for len(queue) > 0 {
		it := queue[0]
		queue = queue[1:]
		if it.info.goRuntime != "" {
			what := path
			if it.path != path {
				what = fmt.Sprintf("%s (needed by %s)", it.path, it.neededBy)
			}
			return nil, status.Errorf(status.Unsupported,
				"Transfer Engine library %s was built by Go (%s): loading it would start a second Go runtime in this process", what, it.info.goRuntime)
		}
		for _, name := range it.info.needed {
			names = append(names, name)
			for _, w := range goWrapperNames {
				if strings.HasPrefix(filepath.Base(name), w) {
					return nil, status.Errorf(status.Unsupported,
						"%s needs %s, a Go c-shared library (a USE_ETCD or k8s-lease build of Mooncake): two Go runtimes cannot share a process; rebuild Transfer Engine without it", it.path, name)
				}
			}
			dep := resolveNeeded(name, it.path, it.info)
			if dep == "" || seen[dep] {
				continue
			}
			seen[dep] = true
			if len(seen) > maxClosure {
				return nil, status.Errorf(status.Config, "Transfer Engine library %s needs more than %d libraries", path, maxClosure)
			}
			info, err := inspectFile(dep)
			if err != nil {
				return nil, status.Wrap(status.Config, err, fmt.Sprintf("library %s needed by %s", dep, it.path))
			}
			queue = append(queue, item{path: dep, neededBy: it.path, info: info})
		}
	}
	return names, nil
}

// resolveNeeded finds the file the dynamic loader would map for a DT_NEEDED
// entry of the object at from: DT_RPATH (when there is no DT_RUNPATH),
// LD_LIBRARY_PATH, DT_RUNPATH, the ld.so.conf directories, then the default
// directories. "" when nothing matches; the loader will then fail on its own.
func resolveNeeded(name, from string, info elfInfo) string {
	if strings.Contains(name, "/") {
		return name
	}
	origin := filepath.Dir(from)
	var dirs []string
	if len(info.runpath) == 0 {
		dirs = append(dirs, info.rpath...)
	}
	dirs = append(dirs, filepath.SplitList(os.Getenv("LD_LIBRARY_PATH"))...)
	dirs = append(dirs, info.runpath...)
	dirs = append(dirs, ldconfigDirs("/etc/ld.so.conf", 0)...)
	dirs = append(dirs, defaultLibDirs()...)
	for _, d := range dirs {
		if d == "" || strings.Contains(d, "$LIB") || strings.Contains(d, "$PLATFORM") ||
			strings.Contains(d, "${LIB}") || strings.Contains(d, "${PLATFORM}") {
			continue
		}
		d = strings.ReplaceAll(strings.ReplaceAll(d, "${ORIGIN}", origin), "$ORIGIN", origin)
		p := filepath.Join(d, name)
		if _, err := os.Stat(p); err == nil && compatible(p) {
			if real, err := filepath.EvalSymlinks(p); err == nil {
				return real
			}
			return p
		}
	}
	return ""
}

func defaultLibDirs() []string {
	triple := "x86_64-linux-gnu"
	if runtime.GOARCH == "arm64" {
		triple = "aarch64-linux-gnu"
	}
	return []string{
		"/lib/" + triple, "/usr/lib/" + triple, "/lib64", "/usr/lib64", "/lib", "/usr/lib",
	}
}

// ldconfigDirs lists the directories named by an ld.so.conf file, following
// its include lines (glob patterns) a few levels deep.
func ldconfigDirs(path string, depth int) []string {
	data, err := os.ReadFile(path)
	if err != nil || depth > 4 {
		return nil
	}
	var dirs []string
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = strings.TrimSpace(line[:i])
		}
		switch {
		case line == "":
		case strings.HasPrefix(line, "include"):
			pattern := strings.TrimSpace(strings.TrimPrefix(line, "include"))
			if !filepath.IsAbs(pattern) {
				pattern = filepath.Join(filepath.Dir(path), pattern)
			}
			matches, _ := filepath.Glob(pattern)
			for _, m := range matches {
				dirs = append(dirs, ldconfigDirs(m, depth+1)...)
			}
		default:
			dirs = append(dirs, line)
		}
	}
	return dirs
}
