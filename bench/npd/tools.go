//go:build tools

// Package tools pins node-problem-detector for the side-by-side benchmark
// (bench/npd.rs). bench/npd-build builds its command from this module with
// `go build`: `go install pkg@version` needs the module proxy's version list,
// which this machine's proxy refuses for k8s.io/node-problem-detector.
package tools

import _ "k8s.io/node-problem-detector/cmd/nodeproblemdetector"
