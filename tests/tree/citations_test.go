// Package tree checks the repository as files: what its comments, strings
// and scripts say about its own layout.
package tree

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// foreign are paths that files outside docs/ cite in another project's
// tree, which a repository path of the same name would otherwise shadow.
var foreign = map[string]string{
	"include/llama.h":            "llama.cpp's public header",
	"include/types.h":            "Mooncake's Transfer Engine error codes",
	"scripts/ui-assets.cmake":    "llama.cpp's UI embedding",
	"tests/test-llama-archs.cpp": "llama.cpp's writer of a model of every architecture",
}

// repoFiles is every file git tracks, relative to the top of the checkout.
func repoFiles(t *testing.T) (top string, files []string) {
	t.Helper()
	out, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	require.NoError(t, err, "the test reads the checkout through git")
	top = strings.TrimSpace(string(out))
	out, err = exec.Command("git", "-C", top, "ls-files", "-z").Output()
	require.NoError(t, err)
	for _, f := range strings.Split(string(out), "\x00") {
		if f != "" {
			files = append(files, f)
		}
	}
	return top, files
}

// Every path a file outside docs/ names under one of the repository's
// top-level directories exists: as written from the top, or from the
// file's own directory, as a glob that matches, or as the number that
// starts a file's name (llama-patches/0006). Paths git ignores (build
// outputs such as bench/out/) are outputs, not citations. A file name
// alone in a Go comment ("(citations_test.go)") is a file of the comment's
// package, or of a directory named on the same line.
func TestCitedPathsExist(t *testing.T) {
	top, files := repoFiles(t)
	tracked := map[string]bool{}
	var tops []string
	for _, f := range files {
		tracked[f] = true
		for d := path.Dir(f); d != "."; d = path.Dir(d) {
			if !tracked[d] {
				tracked[d] = true
				if !strings.Contains(d, "/") && !strings.HasPrefix(d, ".") {
					tops = append(tops, regexp.QuoteMeta(d))
				}
			}
		}
	}
	sort.Strings(tops)
	cite := regexp.MustCompile(`(?:^|[\s"'` + "`" + `(\[<,:])((?:` + strings.Join(tops, "|") + `)/[\w.*/-]*[\w*/])`)
	goFile := regexp.MustCompile(`(?:^|[^\w./-])([\w-]+\.go)\b`)
	exists := func(from, p string) bool {
		for _, c := range []string{p, path.Join(from, p)} {
			c = strings.TrimSuffix(c, "/")
			if tracked[c] {
				return true
			}
			if strings.ContainsAny(c, "*[") {
				if m, _ := filepath.Glob(filepath.Join(top, c)); len(m) > 0 {
					return true
				}
			}
			if m, _ := filepath.Glob(filepath.Join(top, c) + "-*"); len(m) > 0 {
				return true
			}
		}
		return false
	}
	// A directory pattern matches a path git cannot see on the disk only
	// with its trailing slash.
	ignored := func(p string) bool {
		p = strings.TrimSuffix(p, "/")
		return exec.Command("git", "-C", top, "check-ignore", "-q", "--no-index", p).Run() == nil ||
			exec.Command("git", "-C", top, "check-ignore", "-q", "--no-index", p+"/").Run() == nil
	}
	var stale []string
	for _, f := range files {
		if strings.HasPrefix(f, "docs/") || strings.HasPrefix(f, "llama-patches/") && strings.HasSuffix(f, ".patch") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(top, f))
		require.NoError(t, err)
		if bytes.IndexByte(b, 0) >= 0 || !utf8.Valid(b) {
			continue
		}
		for i, line := range strings.Split(string(b), "\n") {
			dirs := []string{path.Dir(f)}
			for _, m := range cite.FindAllStringSubmatch(line, -1) {
				p := m[1]
				dirs = append(dirs, strings.TrimSuffix(p, "/"))
				if _, ok := foreign[p]; ok || exists(path.Dir(f), p) || ignored(p) {
					continue
				}
				stale = append(stale, fmt.Sprintf("%s:%d: %s", f, i+1, p))
			}
			// A Go comment's bare file name is one of its package's files,
			// or of a directory the same line names.
			_, comment, ok := strings.Cut(line, "//")
			if !strings.HasSuffix(f, ".go") || !ok {
				continue
			}
			for _, m := range goFile.FindAllStringSubmatch(comment, -1) {
				found := false
				for _, d := range dirs {
					found = found || tracked[path.Join(d, m[1])]
				}
				if !found {
					stale = append(stale, fmt.Sprintf("%s:%d: %s", f, i+1, m[1]))
				}
			}
		}
	}
	require.Empty(t, stale, "paths cited that do not exist")
}
