package strata

// go test reads its inputs from the environment (bindings/test-all.sh sets them):
//   STRATA_PACK            pack directory (the tests skip without it)
//   STRATA_PROMPT          comma-separated token ids (default 1,2,3,4,5)
//   STRATA_N, STRATA_SEED, STRATA_TEMPERATURE, STRATA_TOP_K, STRATA_TOP_P
//   STRATA_EXPECT_GREEDY   tokens `strata generate` printed greedily
//   STRATA_EXPECT_SAMPLED  tokens it printed with the sampling above

import (
	"errors"
	"os"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
)

func env(t *testing.T, name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	if def == "" {
		t.Skipf("%s is not set", name)
	}
	return def
}

func parseTokens(t *testing.T, s string) []int32 {
	var out []int32
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' }) {
		v, err := strconv.ParseInt(f, 10, 32)
		if err != nil {
			t.Fatalf("bad token list %q: %v", s, err)
		}
		out = append(out, int32(v))
	}
	return out
}

func num(t *testing.T, name, def string) float64 {
	v, err := strconv.ParseFloat(env(t, name, def), 64)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return v
}

func setup(t *testing.T) (*Engine, []int32) {
	pack := env(t, "STRATA_PACK", "")
	e, err := Load(pack, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e, parseTokens(t, env(t, "STRATA_PROMPT", "1,2,3,4,5"))
}

func generate(t *testing.T, e *Engine, prompt []int32, n int, sp Sampling) []int32 {
	s, err := e.NewSession(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Prefill(prompt); err != nil {
		t.Fatal(err)
	}
	out, err := s.Generate(n, sp)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func format(tokens []int32) string {
	parts := make([]string, len(tokens))
	for i, v := range tokens {
		parts[i] = strconv.Itoa(int(v))
	}
	return strings.Join(parts, " ")
}

// The same tokens as the Rust API (`strata generate`), greedy and sampled.
func TestGenerateMatchesRust(t *testing.T) {
	e, prompt := setup(t)
	n := int(num(t, "STRATA_N", "16"))
	greedy := generate(t, e, prompt, n, Greedy)
	t.Logf("greedy:  %s", format(greedy))
	if want := os.Getenv("STRATA_EXPECT_GREEDY"); want != "" {
		if got := format(greedy); got != format(parseTokens(t, want)) {
			t.Errorf("greedy tokens\n got  %s\n want %s", got, want)
		}
	}
	seed, err := strconv.ParseUint(env(t, "STRATA_SEED", "42"), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	sp := Sampling{
		Temperature: float32(num(t, "STRATA_TEMPERATURE", "0.8")),
		TopK:        int32(num(t, "STRATA_TOP_K", "40")),
		TopP:        float32(num(t, "STRATA_TOP_P", "0.95")),
		Seed:        seed,
	}
	sampled := generate(t, e, prompt, n, sp)
	t.Logf("sampled: %s", format(sampled))
	if want := os.Getenv("STRATA_EXPECT_SAMPLED"); want != "" {
		if got := format(sampled); got != format(parseTokens(t, want)) {
			t.Errorf("sampled tokens\n got  %s\n want %s", got, want)
		}
	}
	// The same seed gives the same tokens again.
	if again := generate(t, e, prompt, n, sp); !reflect.DeepEqual(again, sampled) {
		t.Errorf("same seed, different tokens: %v vs %v", again, sampled)
	}
}

// Generate ends before the first end-of-generation token. The test pack
// names none, so the session is given one: the first new token greedy
// decoding samples after the first.
func TestGenerateStopsAtEOS(t *testing.T) {
	e, prompt := setup(t)
	if len(e.EOSTokens) != 0 {
		t.Fatalf("the test pack names no end-of-generation token, Load read %v", e.EOSTokens)
	}
	greedy := generate(t, e, prompt, 12, Greedy)
	k := 0
	for i := 1; i < len(greedy) && k == 0; i++ {
		if !contains(greedy[:i], greedy[i]) {
			k = i
		}
	}
	s, err := e.NewSession(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.eos = []int32{greedy[k]}
	if err := s.Prefill(prompt); err != nil {
		t.Fatal(err)
	}
	out, err := s.Generate(12, Greedy)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(out, greedy[:k]) {
		t.Errorf("with end-of-generation token %d: got %v, want %v", greedy[k], out, greedy[:k])
	}
	if pos, _ := s.Position(); pos != len(prompt)+k+1 {
		t.Errorf("position %d after stopping, want %d (the end token is in the session)", pos, len(prompt)+k+1)
	}
	// GenerateAll runs on past it: the greedy continuation after the end token.
	rest, err := s.GenerateAll(len(greedy)-k-1, Greedy)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(rest, greedy[k+1:]) {
		t.Errorf("GenerateAll after the end token: got %v, want %v", rest, greedy[k+1:])
	}
}

func TestErrors(t *testing.T) {
	e, prompt := setup(t)
	if _, err := Load("/nonexistent/strata/pack", nil); !errors.Is(err, ErrIO) {
		t.Errorf("missing pack: got %v, want ErrIO", err)
	}
	if _, err := Load("\xff\xfe/not-utf8", nil); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("invalid UTF-8 path: got %v, want ErrInvalidArgument", err)
	}
	s, err := e.NewSession(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Prefill(prompt); err != nil {
		t.Fatal(err)
	}
	err = s.Prefill([]int32{1, int32(e.Info.VocabSize)})
	var se *Error
	if !errors.As(err, &se) || se.Status != ErrTokenOutOfRange || se.Message == "" {
		t.Errorf("out-of-range token: got %#v", err)
	} else {
		t.Logf("as expected: %v", err)
	}
	if pos, _ := s.Position(); pos != len(prompt) {
		t.Errorf("position %d after a rejected prefill, want %d", pos, len(prompt))
	}
	if err := s.Rewind(0xDEADBEEF); !errors.Is(err, ErrNotFound) {
		t.Errorf("unknown checkpoint: got %v, want ErrNotFound", err)
	}
	if _, err := s.Step(Sampling{Temperature: -1}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("negative temperature: got %v, want ErrInvalidArgument", err)
	}
	if !e.Info.HasTokenizer {
		if _, err := e.Tokenize("hello"); !errors.Is(err, ErrTokenizer) {
			t.Errorf("tokenize without a tokenizer: got %v, want ErrTokenizer", err)
		}
	}
}

func TestCheckpointAndState(t *testing.T) {
	e, prompt := setup(t)
	s, err := e.NewSession(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Prefill(prompt); err != nil {
		t.Fatal(err)
	}
	cp, err := s.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	first, err := s.Generate(8, Greedy)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Rewind(cp); err != nil {
		t.Fatal(err)
	}
	if pos, _ := s.Position(); pos != len(prompt) {
		t.Fatalf("position %d after rewind, want %d", pos, len(prompt))
	}
	state, err := s.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	again, err := s.Generate(8, Greedy)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(first, again) {
		t.Errorf("after rewind: %v, first time: %v", again, first)
	}

	// The state goes into a second session, even after the engine is closed
	// (sessions keep the model alive).
	other, err := e.NewSession(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	e.Close()
	if err := other.LoadState(state); err != nil {
		t.Fatal(err)
	}
	third, err := other.Generate(8, Greedy)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(first, third) {
		t.Errorf("from saved state: %v, original: %v", third, first)
	}
	if err := other.LoadState(state[:len(state)/2]); err == nil {
		t.Errorf("a truncated state was accepted")
	}
}

// PrefillConversation reuses the prefix the session holds, reports the
// counts, and ends with the logits a plain prefill of the same tokens gives.
func TestPrefillConversation(t *testing.T) {
	e, prompt := setup(t)
	if len(prompt) < 2 {
		t.Skip("needs a prompt of at least 2 tokens")
	}
	s, err := e.NewSession(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	half := len(prompt) / 2
	if reused, read, err := s.PrefillConversation(prompt[:half]); err != nil || reused != 0 || read != half {
		t.Fatalf("first half: reused %d read %d err %v, want 0, %d", reused, read, err, half)
	}
	if reused, read, err := s.PrefillConversation(prompt); err != nil || reused != half || read != len(prompt)-half {
		t.Fatalf("whole prompt: reused %d read %d err %v, want %d, %d", reused, read, err, half, len(prompt)-half)
	}
	fresh, err := e.NewSession(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer fresh.Close()
	if err := fresh.Prefill(prompt); err != nil {
		t.Fatal(err)
	}
	a, _ := s.Logits(-1)
	b, _ := fresh.Logits(-1)
	if !reflect.DeepEqual(a, b) {
		t.Errorf("logits after the reused prefix differ from a plain prefill")
	}
	if _, _, err := s.PrefillConversation(nil); err == nil {
		t.Errorf("an empty conversation was accepted")
	}
}

// The state carries the sampler's random stream: a session loaded from it
// continues a seeded run with the same tokens as the original.
func TestStateCarriesSampler(t *testing.T) {
	e, prompt := setup(t)
	sp := Sampling{Temperature: 1, Seed: 7}
	a, err := e.NewSession(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := a.Prefill(prompt); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Generate(4, sp); err != nil {
		t.Fatal(err)
	}
	state, err := a.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	b, err := e.NewSession(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.LoadState(state); err != nil {
		t.Fatal(err)
	}
	want, err := a.Generate(12, sp)
	if err != nil {
		t.Fatal(err)
	}
	got, err := b.Generate(12, sp)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("loaded session: %v, original: %v", got, want)
	}
}

// The engine is shared by goroutines, each with its own session.
func TestConcurrentSessions(t *testing.T) {
	e, prompt := setup(t)
	want := generate(t, e, prompt, 8, Greedy)
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := e.NewSession(nil)
			if err != nil {
				errs <- err.Error()
				return
			}
			defer s.Close()
			if err := s.Prefill(prompt); err != nil {
				errs <- err.Error()
				return
			}
			got, err := s.Generate(8, Greedy)
			if err != nil {
				errs <- err.Error()
			} else if !reflect.DeepEqual(got, want) {
				errs <- "different tokens: " + format(got)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for msg := range errs {
		t.Error(msg)
	}
}
