// Command kube-controller-manager is the upstream controller manager, built
// from the k8s.io/kubernetes module (disruption, garbage-collector, namespace
// and service-account-token controllers are what nodeguard's tests rely on).
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	os.Exit(cli.Run(app.NewControllerManagerCommand()))
}
