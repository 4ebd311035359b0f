// Command goregex answers, with Go's own regexp package, what a Go pattern
// matches: the oracle tests/npd.rs holds nodeguard's translation of
// node-problem-detector's (Go) patterns to. One JSON object per input line,
// {"pattern": …, "input": …}; one per output line, {"error": …} when Go
// refuses the pattern, else {"match": [start, end]} (byte offsets of the
// leftmost match) or {"match": null}.
package main

import (
	"bufio"
	"encoding/json"
	"os"
	"regexp"
)

type query struct {
	Pattern string `json:"pattern"`
	Input   string `json:"input"`
}

type answer struct {
	Error string `json:"error,omitempty"`
	Match []int  `json:"match"`
}

func main() {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<24)
	out := json.NewEncoder(os.Stdout)
	compiled := map[string]*regexp.Regexp{}
	failed := map[string]string{}
	for in.Scan() {
		var q query
		if err := json.Unmarshal(in.Bytes(), &q); err != nil {
			panic(err)
		}
		var a answer
		re, ok := compiled[q.Pattern]
		if msg, bad := failed[q.Pattern]; bad {
			a.Error = msg
		} else if !ok {
			var err error
			re, err = regexp.Compile(q.Pattern)
			if err != nil {
				failed[q.Pattern] = err.Error()
				a.Error = err.Error()
			} else {
				compiled[q.Pattern] = re
			}
		}
		if a.Error == "" {
			a.Match = re.FindStringIndex(q.Input)
		}
		if err := out.Encode(a); err != nil {
			panic(err)
		}
	}
	if err := in.Err(); err != nil {
		panic(err)
	}
}
