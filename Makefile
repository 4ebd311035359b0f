# The two commands of the README, plus helpers. Scripts live in e2e/.
.PHONY: demo demo-vm demo-stop test bench cluster-up cluster-down crd manifests image

demo:         ## control plane up, agent running against it, results shown (DEMO=vm: a real node VM powers off)
	e2e/demo $(DEMO)

demo-vm:      ## a real node: Debian VM with logind powers off and reboots; describe node shown
	e2e/demo vm

demo-stop:    ## stop the demo agent and the control plane
	e2e/demo stop

test:         ## everything CI runs: setup, fmt, clippy, all tests against the real control plane
	e2e/test-all

bench:        ## every benchmark beside node-problem-detector; writes bench/RESULTS.md (about three and a half hours)
	bench/run

cluster-up:
	e2e/setup && e2e/cluster/up

cluster-down:
	e2e/cluster/down

crd:          ## regenerate crds/ (and the chart's copy) from the Rust types
	cargo run --quiet -- crd > crds/nodeguard.io_nodeguardpolicies.yaml
	cp crds/nodeguard.io_nodeguardpolicies.yaml charts/nodeguard/crds/

manifests: crd ## render manifests/nodeguard.yaml from the chart with default values (no Helm hooks)
	cargo run --quiet -- default-policy > charts/nodeguard/files/default-policy.yaml
	$$(e2e/cluster/build >/dev/null 2>&1; echo $${NODEGUARD_CACHE:-$$HOME/.cache/nodeguard}/bin/current/helm) \
	  template nodeguard charts/nodeguard -n nodeguard-system --include-crds --no-hooks \
	  --kube-version $$(. e2e/cluster/versions.env; echo $$KUBE_OLDEST_VERSION) > manifests/nodeguard.yaml

image:        ## build the OCI image without Docker (target/image/)
	e2e/image
