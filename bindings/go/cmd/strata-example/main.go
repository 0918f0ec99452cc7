// strata-example: the Go binding end to end.
//
//	go run ./cmd/strata-example PACK TOKENS N SEED [TEMPERATURE [TOP_K [TOP_P [MIN_P]]]]
//
// Prints the N generated tokens on stdout as one line of space-separated ids.
package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"strata.example/strata"
)

func main() {
	if err := run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "strata-example:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) < 5 || len(args) > 9 {
		return fmt.Errorf("usage: %s PACK TOKENS N SEED [TEMPERATURE [TOP_K [TOP_P [MIN_P]]]]", args[0])
	}
	n, err := strconv.Atoi(args[3])
	if err != nil {
		return err
	}
	seed, err := strconv.ParseUint(args[4], 10, 64)
	if err != nil {
		return err
	}
	sp := strata.Sampling{Seed: seed, TopP: 1}
	floats := []*float32{&sp.Temperature, nil, &sp.TopP, &sp.MinP}
	for i, a := range args[5:] {
		if i == 1 {
			k, err := strconv.ParseInt(a, 10, 32)
			if err != nil {
				return err
			}
			sp.TopK = int32(k)
			continue
		}
		f, err := strconv.ParseFloat(a, 32)
		if err != nil {
			return err
		}
		*floats[i] = float32(f)
	}

	engine, err := strata.Load(args[1], nil)
	if err != nil {
		return err
	}
	defer engine.Close()
	fmt.Fprintf(os.Stderr, "strata %s, C ABI %d, model %+v\n", strata.Version(), strata.ABIVersion(), engine.Info)

	var prompt []int32
	for _, f := range strings.Split(args[2], ",") {
		v, err := strconv.ParseInt(f, 10, 32)
		if err != nil {
			prompt = nil
			break
		}
		prompt = append(prompt, int32(v))
	}
	if prompt == nil { // text: needs a pack with a tokenizer
		if prompt, err = engine.Tokenize(args[2]); err != nil {
			return err
		}
	}

	s, err := engine.NewSession(nil)
	if err != nil {
		return err
	}
	defer s.Close()
	if err := s.Prefill(prompt); err != nil {
		return err
	}
	out, err := s.Generate(n, sp)
	if err != nil {
		return err
	}
	parts := make([]string, len(out))
	for i, t := range out {
		parts[i] = strconv.Itoa(int(t))
	}
	fmt.Println(strings.Join(parts, " "))
	if engine.Info.HasTokenizer {
		text, err := engine.Detokenize(out)
		if err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "text: %s\n", text)
	}
	return nil
}
