// Command mcb-gguf writes a random-weight llama model from a preset, or describes a
// GGUF file.
//
//	mcb-gguf -preset tiny -o tiny.gguf [-seed 7] [-layers 3] [-ctx 8192]
//	mcb-gguf -preset tiny -lora 8 -o tiny-lora.gguf [-seed 3]   a LoRA adapter for the preset
//	mcb-gguf -info model.gguf
package main

import (
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/mcbridge/mcbridge/internal/gguf"
)

func main() {
	preset := flag.String("preset", "tiny", "preset: "+strings.Join(presetNames(), ", "))
	out := flag.String("o", "", "write the model to this path")
	seed := flag.Uint64("seed", 0, "weights seed (0: the preset's)")
	layers := flag.Int("layers", 0, "block count (0: the preset's)")
	ctx := flag.Int("ctx", 0, "training context length (0: the preset's)")
	info := flag.String("info", "", "describe this GGUF file instead of writing one")
	lora := flag.Int("lora", 0, "write a LoRA adapter of this rank for the preset's model instead (attn_k, attn_v)")
	flag.Parse()

	var err error
	switch {
	case *info != "":
		err = describe(*info)
	case *out != "":
		cfg, ok := gguf.Presets[*preset]
		if !ok {
			err = fmt.Errorf("unknown preset %q (have %s)", *preset, strings.Join(presetNames(), ", "))
			break
		}
		if *seed != 0 {
			cfg.Seed = *seed
		}
		if *layers != 0 {
			cfg.BlockCount = *layers
		}
		if *ctx != 0 {
			cfg.ContextLength = *ctx
		}
		if *lora > 0 {
			err = gguf.WriteLoRAFile(*out, gguf.LoRA{Base: cfg, Rank: *lora, Alpha: 16 * float32(*lora), Seed: cfg.Seed + 1000})
			break
		}
		err = gguf.WriteFile(*out, cfg)
	default:
		flag.Usage()
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "mcb-gguf:", err)
		os.Exit(1)
	}
}

func presetNames() []string {
	var names []string
	for name := range gguf.Presets {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

func describe(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	g, err := gguf.Read(f)
	if err != nil {
		return err
	}
	fmt.Printf("GGUF v%d, %d keys, %d tensors, data at %d (%d bytes, alignment %d)\n",
		g.Version, len(g.Metadata), len(g.Tensors), g.DataOffset, g.DataSize, g.Alignment)
	for _, kv := range g.Metadata {
		fmt.Printf("  %-40s %s\n", kv.Key, kv.Value)
	}
	for _, t := range g.Tensors {
		fmt.Printf("  %-32s %-5s %v\n", t.Name, t.Type, t.Shape)
	}
	return nil
}
