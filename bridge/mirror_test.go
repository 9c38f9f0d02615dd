package main

import (
	"os"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const (
	headerPath = "../include/mcbridge.h"
	shimPath   = "mcbridge.c"
)

// mirrors pairs every struct of the header with its Go mirror.
var mirrors = map[string]reflect.Type{
	"mcb_model_params":  reflect.TypeFor[cModelParams](),
	"mcb_kv_format":     reflect.TypeFor[cKVFormat](),
	"mcb_adapter":       reflect.TypeFor[cAdapter](),
	"mcb_scope":         reflect.TypeFor[cScope](),
	"mcb_kv_layer":      reflect.TypeFor[cKVLayer](),
	"mcb_kv_layout":     reflect.TypeFor[cKVLayout](),
	"mcb_lookup_result": reflect.TypeFor[cLookupResult](),
	"mcb_load_result":   reflect.TypeFor[cLoadResult](),
	"mcb_save_result":   reflect.TypeFor[cSaveResult](),
	"mcb_stats":         reflect.TypeFor[cStats](),
}

// cField is one member of a header struct, placed by the C rules.
type cField struct {
	name        string
	ctype       string // the scalar type, or "*" for any pointer
	count       int    // array length, 1 for a scalar
	size, align int
	offset      int
}

type cStruct struct {
	fields      []cField
	size, align int
}

// scalars are the sizes (and alignments) of the header's types on the
// LP64 targets llama.cpp is built for.
var scalars = map[string]struct {
	size int
	kind reflect.Kind
}{
	"*":        {8, reflect.Uintptr},
	"bool":     {1, reflect.Bool},
	"uint8_t":  {1, reflect.Uint8},
	"int32_t":  {4, reflect.Int32},
	"uint32_t": {4, reflect.Uint32},
	"float":    {4, reflect.Float32},
	"uint64_t": {8, reflect.Uint64},
	"size_t":   {8, reflect.Uint64},
	"mcb_plan": {8, reflect.Uint64},
	"double":   {8, reflect.Float64},
}

func readSource(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return regexp.MustCompile(`(?s)/\*.*?\*/|//[^\n]*`).ReplaceAllString(string(b), " ")
}

var (
	structRE = regexp.MustCompile(`struct\s+(mcb_\w+)\s*\{([^}]*)\}\s*;`)
	memberRE = regexp.MustCompile(`^(?:const\s+)?(struct\s+\w+|\w+)\s*(\*?)\s*(\w+)\s*(?:\[(\d+)\])?$`)
)

// parseHeader lays out every struct of the header by the C rules: each
// member at the next multiple of its alignment, the struct padded to a
// multiple of its largest member's alignment.
func parseHeader(t *testing.T) map[string]cStruct {
	t.Helper()
	out := map[string]cStruct{}
	for _, m := range structRE.FindAllStringSubmatch(readSource(t, headerPath), -1) {
		var s cStruct
		off := 0
		for _, decl := range strings.Split(m[2], ";") {
			decl = strings.Join(strings.Fields(decl), " ")
			if decl == "" {
				continue
			}
			d := memberRE.FindStringSubmatch(decl)
			require.NotNil(t, d, "struct %s: cannot read member %q; teach the test this declaration", m[1], decl)
			f := cField{name: d[3], ctype: d[1], count: 1}
			if d[2] == "*" {
				f.ctype = "*"
			}
			sc, ok := scalars[f.ctype]
			require.True(t, ok, "struct %s.%s: type %q has no known size", m[1], f.name, f.ctype)
			if d[4] != "" {
				f.count, _ = strconv.Atoi(d[4])
			}
			f.align, f.size = sc.size, sc.size*f.count
			off = (off + f.align - 1) / f.align * f.align
			f.offset = off
			off += f.size
			s.align = max(s.align, f.align)
			s.fields = append(s.fields, f)
		}
		s.size = (off + s.align - 1) / s.align * s.align
		out[m[1]] = s
	}
	return out
}

// sameName matches a C member with its Go field: n_embd_k_gqa and NEmbdKGQA.
func sameName(c, goName string) bool {
	return strings.ReplaceAll(c, "_", "") == strings.ToLower(goName)
}

// goFields returns the named fields of a mirror; blank fields are padding.
func goFields(t *testing.T, typ reflect.Type) []reflect.StructField {
	t.Helper()
	var out []reflect.StructField
	for i := 0; i < typ.NumField(); i++ {
		f := typ.Field(i)
		if f.Name == "_" {
			assert.True(t, f.Type.Kind() == reflect.Array && f.Type.Elem().Kind() == reflect.Uint8,
				"%s: padding field of type %s, want a byte array", typ.Name(), f.Type)
			continue
		}
		out = append(out, f)
	}
	return out
}

func goField(t *testing.T, typ reflect.Type, cname string) (reflect.StructField, bool) {
	for _, f := range goFields(t, typ) {
		if sameName(cname, f.Name) {
			return f, true
		}
	}
	return reflect.StructField{}, false
}

// TestMirrorLayout checks every Go mirror against its struct in the
// header, laid out here by the C rules: the same members in the same
// order, each at the same offset with the same size and kind, and the same
// size and alignment for the whole.
func TestMirrorLayout(t *testing.T) {
	header := parseHeader(t)
	for name := range mirrors {
		assert.Contains(t, header, name, "mirror of struct %s, which the header does not define", name)
	}
	for name, cs := range header {
		typ, ok := mirrors[name]
		if !assert.True(t, ok, "struct %s has no Go mirror", name) {
			continue
		}
		t.Run(name, func(t *testing.T) {
			assert.Equal(t, cs.size, int(typ.Size()), "size of %s, struct %s", typ.Name(), name)
			assert.Equal(t, cs.align, typ.Align(), "alignment of %s, struct %s", typ.Name(), name)
			gf := goFields(t, typ)
			require.Len(t, gf, len(cs.fields), "%s has %d fields, struct %s %d members", typ.Name(), len(gf), name, len(cs.fields))
			for i, c := range cs.fields {
				g := gf[i]
				assert.True(t, sameName(c.name, g.Name), "member %d: C %s, Go %s", i, c.name, g.Name)
				assert.Equal(t, c.offset, int(g.Offset), "%s: offset", c.name)
				assert.Equal(t, c.size, int(g.Type.Size()), "%s: size", c.name)
				kind := g.Type.Kind()
				if c.count > 1 {
					if !assert.True(t, kind == reflect.Array && g.Type.Len() == c.count, "%s: Go %s, C %s[%d]", c.name, g.Type, c.ctype, c.count) {
						continue
					}
					kind = g.Type.Elem().Kind()
				}
				assert.Equal(t, scalars[c.ctype].kind, kind, "%s: Go kind %s, C %s", c.name, kind, c.ctype)
			}
		})
	}
}

var (
	assertRE = regexp.MustCompile(`_Static_assert\s*\(\s*(sizeof|offsetof)\s*\(\s*struct\s+(\w+)\s*(?:,\s*(\w+)\s*)?\)\s*==\s*([0-9 *+]+),`)
	numberRE = regexp.MustCompile(`^\d+$`)
)

// evalSum evaluates the sums of products of integers the asserts use.
func evalSum(t *testing.T, expr string) int {
	t.Helper()
	sum := 0
	for _, term := range strings.Split(expr, "+") {
		prod := 1
		for _, f := range strings.Split(term, "*") {
			f = strings.TrimSpace(f)
			require.Regexp(t, numberRE, f, "cannot evaluate %q", expr)
			n, _ := strconv.Atoi(f)
			prod *= n
		}
		sum += prod
	}
	return sum
}

// TestStaticAsserts reads the layout the C shims assert at compile time
// and checks that the Go mirrors and the header agree with every number.
// An assert this test cannot read, or one naming a struct or member it
// does not know, fails it: the two sides cannot drift apart silently.
func TestStaticAsserts(t *testing.T) {
	src := readSource(t, shimPath)
	header := parseHeader(t)
	asserts := assertRE.FindAllStringSubmatch(src, -1)
	total := strings.Count(src, "_Static_assert")
	require.NotZero(t, total, "no _Static_assert lines in %s", shimPath)
	require.Len(t, asserts, total, "read %d of the %d _Static_assert lines of %s", len(asserts), total, shimPath)
	sized := map[string]bool{}
	for _, a := range asserts {
		what, name, member, want := a[1], a[2], a[3], evalSum(t, a[4])
		typ, ok := mirrors[name]
		if !assert.True(t, ok, "%s asserts on struct %s, which has no mirror", shimPath, name) {
			continue
		}
		cs := header[name]
		if what == "sizeof" {
			sized[name] = true
			assert.Equal(t, want, int(typ.Size()), "sizeof(struct %s): asserted, Go", name)
			assert.Equal(t, want, cs.size, "sizeof(struct %s): asserted, header", name)
			continue
		}
		g, ok := goField(t, typ, member)
		if !assert.True(t, ok, "offsetof(struct %s, %s): no such field in %s", name, member, typ.Name()) {
			continue
		}
		var c *cField
		for i := range cs.fields {
			if cs.fields[i].name == member {
				c = &cs.fields[i]
			}
		}
		if !assert.NotNil(t, c, "offsetof(struct %s, %s): no such member in the header", name, member) {
			continue
		}
		assert.Equal(t, want, int(g.Offset), "offsetof(struct %s, %s): asserted, Go", name, member)
		assert.Equal(t, want, c.offset, "offsetof(struct %s, %s): asserted, header", name, member)
	}
	for name := range mirrors {
		assert.True(t, sized[name], "%s does not assert sizeof(struct %s)", shimPath, name)
	}
}

// enumValues reads the NAME = value lines of the header's enum with prefix.
func enumValues(t *testing.T, prefix string) map[string]int {
	t.Helper()
	out := map[string]int{}
	re := regexp.MustCompile(prefix + `(\w+)\s*=\s*(\d+)`)
	for _, m := range re.FindAllStringSubmatch(readSource(t, headerPath), -1) {
		out[m[1]], _ = strconv.Atoi(m[2])
	}
	require.NotEmpty(t, out, "no %s values in %s", prefix, headerPath)
	return out
}

// shimStrings reads the case NAME: return "text"; lines of a C switch.
func shimStrings(t *testing.T, prefix string) map[string]string {
	t.Helper()
	out := map[string]string{}
	re := regexp.MustCompile(`case\s+` + prefix + `(\w+)\s*:\s*return\s+"([^"]*)"`)
	for _, m := range re.FindAllStringSubmatch(readSource(t, shimPath), -1) {
		out[m[1]] = m[2]
	}
	return out
}

// TestStatusCodes ties enum mcb_status, the shim's mcb_status_str and the
// Go status package: the same dense values with the same descriptions.
func TestStatusCodes(t *testing.T) {
	values, texts := enumValues(t, "MCB_STATUS_"), shimStrings(t, "MCB_STATUS_")
	require.Len(t, values, status.Count, "%d statuses in the header, %d in the shim, %d in Go", len(values), len(texts), status.Count)
	require.Len(t, texts, len(values), "%d statuses in the header, %d in the shim, %d in Go", len(values), len(texts), status.Count)
	for name, v := range values {
		assert.Equal(t, status.Code(v).String(), texts[name], "MCB_STATUS_%s = %d: shim, Go", name, v)
	}
}

// TestReasonCodes does the same for enum mcb_reason and the arbiter,
// whose values have one gap.
func TestReasonCodes(t *testing.T) {
	values, texts := enumValues(t, "MCB_REASON_"), shimStrings(t, "MCB_REASON_")
	require.Len(t, texts, len(values), "%d reasons in the header, %d in the shim", len(values), len(texts))
	named, top := map[int]bool{}, 0
	for name, v := range values {
		got := strings.ReplaceAll(arbiter.ReasonCode(v).String(), "-", " ")
		assert.Equal(t, got, texts[name], "MCB_REASON_%s = %d: shim, arbiter", name, v)
		named[v], top = true, max(top, v)
	}
	// The header skips only values the arbiter no longer gives (4).
	for v := 0; v <= top+1; v++ {
		s := arbiter.ReasonCode(v).String()
		assert.Equal(t, !named[v], strings.HasPrefix(s, "reason("), "reason %d: the arbiter says %q, the header has it: %v", v, s, named[v])
	}
}
