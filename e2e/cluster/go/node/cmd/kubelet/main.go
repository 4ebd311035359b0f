// Command kubelet is the upstream kubelet, built from the k8s.io/kubernetes
// module, that turns nodeguard's test VM into a real Kubernetes node.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	// 1.33's NewKubeletCommand takes no context (it gained one later).
	os.Exit(cli.Run(app.NewKubeletCommand()))
}
