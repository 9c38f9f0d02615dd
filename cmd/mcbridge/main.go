// Command mcbridge runs the bridge's services and tools: a store node
// (serve), trace replay (replay), the reverse proxy for stock llama-server
// (proxy) and the GGUF generator for test models (gguf).
package main

import (
	"fmt"
	"os"
	"sort"
)

// command is one subcommand: run gets the arguments after its name.
type command struct {
	summary string
	run     func(args []string) error
}

var commands = map[string]command{}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage()
		return
	}
	c, ok := commands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "mcbridge: unknown command %q\n\n", os.Args[1])
		usage()
		os.Exit(2)
	}
	if err := c.run(os.Args[2:]); err != nil {
		fmt.Fprintf(os.Stderr, "mcbridge %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: mcbridge <command> [flags]\n\ncommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(os.Stderr, "  %-8s %s\n", n, commands[n].summary)
	}
}
