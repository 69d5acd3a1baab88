"""EKS managed node groups on moto (server mode, tests/harness/clouds/moto_server.py), with what moto lacks behind
a node group (shared notes capacity.md §6).

moto's (unchanged, reached with boto3 like the product): the EKS API (create/describe/list/delete cluster and node
group, ``update_nodegroup_config`` merging scaling config, labels and taints and answering ``Successful`` at
once), EC2 (instances, launch templates) and Auto Scaling (an ASG launches EC2 instances at its desired capacity;
``terminate_instance_in_auto_scaling_group`` terminates exactly that instance, and lowers desired with
``ShouldDecrementDesiredCapacity=True`` or launches a replacement with ``False``).

Ours (``EksNodeGroups``), because moto creates no auto scaling group behind a node group (its
``resources.autoScalingGroups[0].name`` points at nothing) and keeps no link between the two:

* ``create``: the cluster (once), the node group, then a launch template and an ASG **named as
  ``describe_nodegroup`` names it** (moto: ``eks-<uuid>``; real EKS: ``eks-<nodegroup>-<uuid>``), with the node
  group's min/max/desired, its instance type, one subnet per zone and the tags EKS puts on it
  (``eks:cluster-name``, ``eks:nodegroup-name``, ``kubernetes.io/cluster/<c>``, the cluster-autoscaler ones).
* ``sync`` (each pass of the node reconciler): both ways, as EKS keeps them: a changed node group scaling config
  (``update_nodegroup_config``) is pushed to the ASG (``update_auto_scaling_group``); a changed ASG (e.g. desired
  lowered by ``terminate_instance_in_auto_scaling_group(ShouldDecrementDesiredCapacity=True)``) is pushed back to
  the node group's ``scalingConfig`` (``update_nodegroup_config``). Instances that leave a group are recorded in
  ``removed`` in order (moto's EC2 keeps them too, ``terminated``).
* ``listing``: the InService instances as kwok Nodes (clouds/nodes.py): ``eks.amazonaws.com/nodegroup``,
  ``eks.amazonaws.com/capacityType``, the node group's labels, providerID ``aws:///<az>/<i-id>``, the private DNS
  name as the node name, GPUs from the product's catalogue.

Where neither moto nor this validates (real EKS/ASG refuse these; the provider must check them itself): min <=
desired <= max on ``update_nodegroup_config`` (moto accepts desired 9 > max 4, and the sync then pushes it to the
ASG, which moto also accepts); a terminate with decrement below MinSize (moto accepts, the node group follows
below its min); ``describe_update`` (moto: 404 "Not yet implemented"); node group statuses other than ACTIVE.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from tests.harness.clouds.nodes import EFFECTS
from tests.harness.clouds.nodes import CloudNode

REGION = "eu-central-1"
ACCOUNT_ROLE = "arn:aws:iam::123456789012:role/"


@dataclass
class EksNodeGroups:
    endpoint: str
    region: str = REGION
    removed: list[dict[str, str]] = field(default_factory=list)  # {nodegroup, instance}, in order
    errors: list[str] = field(default_factory=list)
    _last: dict[tuple[str, str], tuple[int, int, int]] = field(default_factory=dict)  # what both sides last agreed
    _members: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    _account: dict[str, Any] = field(default_factory=dict)
    _seen: dict[tuple[str, str], Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def client(self, service: str) -> Any:
        import boto3

        return boto3.client(service, region_name=self.region, endpoint_url=self.endpoint,
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def create(self, cluster: str, nodegroup: str, *, instance_type: str, min_size: int, max_size: int,
               desired: int, labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None) -> str:
        """The node group and its ASG; returns the ASG's name (the one describe_nodegroup reports)."""
        eks, ec2, asg = self.client("eks"), self.client("ec2"), self.client("autoscaling")
        if not self._account:  # moto's default VPC subnets and an image: read once (moto lists images slowly)
            subnets = ec2.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
            self._account["subnets"] = [s["SubnetId"] for s in sorted(subnets, key=lambda s: s["AvailabilityZone"])]
            self._account["image"] = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        subnet_ids, image = self._account["subnets"], self._account["image"]
        if cluster not in eks.list_clusters()["clusters"]:
            eks.create_cluster(name=cluster, roleArn=ACCOUNT_ROLE + "eks-cluster",
                               resourcesVpcConfig={"subnetIds": subnet_ids})
        eks.create_nodegroup(clusterName=cluster, nodegroupName=nodegroup, subnets=subnet_ids,
                             nodeRole=ACCOUNT_ROLE + "eks-node", instanceTypes=[instance_type],
                             scalingConfig={"minSize": min_size, "maxSize": max_size, "desiredSize": desired},
                             labels=labels or {}, taints=taints or [], capacityType="ON_DEMAND")
        described = eks.describe_nodegroup(clusterName=cluster, nodegroupName=nodegroup)["nodegroup"]
        name = described["resources"]["autoScalingGroups"][0]["name"]
        template = ec2.create_launch_template(LaunchTemplateName=name, LaunchTemplateData={
            "ImageId": image, "InstanceType": instance_type})["LaunchTemplate"]
        tags = {"eks:cluster-name": cluster, "eks:nodegroup-name": nodegroup, f"kubernetes.io/cluster/{cluster}":
                "owned", "k8s.io/cluster-autoscaler/enabled": "true", f"k8s.io/cluster-autoscaler/{cluster}": "owned"}
        asg.create_auto_scaling_group(
            AutoScalingGroupName=name, MinSize=min_size, MaxSize=max_size, DesiredCapacity=desired,
            LaunchTemplate={"LaunchTemplateId": template["LaunchTemplateId"], "Version": "$Latest"},
            VPCZoneIdentifier=",".join(subnet_ids),
            Tags=[{"Key": k, "Value": v, "PropagateAtLaunch": True} for k, v in tags.items()])
        members = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]["Instances"]
        with self._lock:
            self._last[(cluster, nodegroup)] = (min_size, max_size, desired)
            self._members[(cluster, nodegroup)] = {i["InstanceId"] for i in members}  # so a removal before the
        return str(name)  # first sync is recorded too

    def delete(self, cluster: str, nodegroup: str) -> None:
        """The node group and its ASG (its instances terminate, so their Nodes go); no longer synced."""
        eks, asg = self.client("eks"), self.client("autoscaling")
        with self._lock:
            self._last.pop((cluster, nodegroup), None)
            self._members.pop((cluster, nodegroup), None)
            self._seen.pop((cluster, nodegroup), None)
        group = eks.describe_nodegroup(clusterName=cluster, nodegroupName=nodegroup)["nodegroup"]
        asg.delete_auto_scaling_group(AutoScalingGroupName=group["resources"]["autoScalingGroups"][0]["name"],
                                      ForceDelete=True)
        eks.delete_nodegroup(clusterName=cluster, nodegroupName=nodegroup)

    # -- EKS keeping the node group and its ASG consistent ------------------------------------------------
    def sync(self) -> list[tuple[str, str, dict[str, Any], list[dict[str, Any]]]]:
        """One pass: (cluster, nodegroup, the node group, its ASG's instances) of every node group we created."""
        eks, asg = self.client("eks"), self.client("autoscaling")
        out = []
        with self._lock:
            for (cluster, ng), last in list(self._last.items()):
                try:
                    self._seen[(cluster, ng)] = self._sync_one(eks, asg, cluster, ng, last)
                except Exception as exc:  # one broken group (e.g. desired > max pushed to moto) stops no other,
                    self.errors.append(f"{cluster}/{ng}: {exc!r}")  # and keeps what was last seen of it
                    del self.errors[:-20]
                if (cluster, ng) in self._seen:
                    out.append(self._seen[(cluster, ng)])
        return out

    def _sync_one(self, eks: Any, asg: Any, cluster: str, ng: str, last: tuple[int, int, int]
                  ) -> tuple[str, str, dict[str, Any], list[dict[str, Any]]]:
        group = eks.describe_nodegroup(clusterName=cluster, nodegroupName=ng)["nodegroup"]
        name = group["resources"]["autoScalingGroups"][0]["name"]
        a = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]
        sc = group["scalingConfig"]
        ng_cfg = (sc["minSize"], sc["maxSize"], sc["desiredSize"])
        asg_cfg = (a["MinSize"], a["MaxSize"], a["DesiredCapacity"])
        if ng_cfg != last:  # update_nodegroup_config -> the ASG
            asg.update_auto_scaling_group(AutoScalingGroupName=name, MinSize=ng_cfg[0], MaxSize=ng_cfg[1],
                                          DesiredCapacity=ng_cfg[2])
            self._last[(cluster, ng)] = ng_cfg
            a = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]
        elif asg_cfg != last:  # the ASG changed (a terminate with decrement) -> the node group
            eks.update_nodegroup_config(clusterName=cluster, nodegroupName=ng, scalingConfig={
                "minSize": asg_cfg[0], "maxSize": asg_cfg[1], "desiredSize": asg_cfg[2]})
            self._last[(cluster, ng)] = asg_cfg
        members = {i["InstanceId"] for i in a["Instances"]}
        for gone in sorted(self._members.get((cluster, ng), set()) - members):
            self.removed.append({"nodegroup": ng, "instance": gone})
        self._members[(cluster, ng)] = members
        return cluster, ng, group, a["Instances"]

    def listing(self) -> list[CloudNode]:
        from activities.providers.catalog import AWS_GPU_INSTANCES

        gpus = {o.instance_type: o.gpus for o in AWS_GPU_INSTANCES}
        ec2 = self.client("ec2")
        out = []
        for _, ng, group, instances in self.sync():
            ids = [i["InstanceId"] for i in instances if i["LifecycleState"] == "InService"]
            if not ids:
                continue
            found = ec2.describe_instances(InstanceIds=ids)["Reservations"]
            for inst in (i for r in found for i in r["Instances"]):
                if inst["State"]["Name"] not in ("pending", "running"):
                    continue
                zone = inst["Placement"]["AvailabilityZone"]
                labels = {"eks.amazonaws.com/nodegroup": ng, "eks.amazonaws.com/capacityType":
                          group.get("capacityType", "ON_DEMAND"), "node.kubernetes.io/instance-type":
                          inst["InstanceType"], "topology.kubernetes.io/zone": zone, **group.get("labels", {})}
                taints = tuple((t["key"], t.get("value", ""), EFFECTS[t["effect"]]) for t in group.get("taints", []))
                out.append(CloudNode(inst["PrivateDnsName"], f"aws:///{zone}/{inst['InstanceId']}", labels,
                                     gpus.get(inst["InstanceType"], 0), taints=taints))
        return out


class MotoRecorder:
    """A loopback HTTP forwarder in front of moto that records every AWS request the product sends (moto keeps no
    request log): ``requests()`` -> [{service, action, params, time}], the action being the Query protocol's
    ``Action`` (autoscaling, ec2, sts) or ``METHOD path`` for REST-JSON (eks). Fault ``slow_remove_seconds``:
    a ``TerminateInstanceInAutoScalingGroup`` is forwarded (moto terminates the instance) and its answer then
    waits this long, the window in which a worker is killed. Point the product's ``endpoint_url`` here; the
    harness's own calls (``EksNodeGroups``) go to moto directly and are not recorded."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.url = ""
        self.faults: dict[str, float] = {}
        self._log: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._server: Any = None

    def __enter__(self) -> MotoRecorder:
        from werkzeug.serving import make_server

        self._server = make_server("127.0.0.1", 0, self._app, threaded=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()

    def requests(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._log)

    def clear(self) -> None:
        with self._lock:
            self._log.clear()
            self.faults.clear()

    def _app(self, environ: dict[str, Any], start_response: Any) -> Any:
        import http.client
        import time
        import urllib.parse

        from werkzeug.wrappers import Request
        from werkzeug.wrappers import Response

        request = Request(environ)
        body = request.get_data()
        auth = request.headers.get("Authorization", "")
        scope = auth.split("Credential=", 1)[1].split(",", 1)[0].split("/") if "Credential=" in auth else []
        service = scope[3] if len(scope) > 3 else ""
        params: dict[str, Any] = {}
        if request.mimetype == "application/x-www-form-urlencoded":
            params = dict(urllib.parse.parse_qsl(body.decode()))
            action = params.pop("Action", "")
            params.pop("Version", None)
        else:
            action = f"{request.method} {request.path}"
            if body:
                import json

                try:
                    params = json.loads(body)
                except ValueError:
                    params = {}
        with self._lock:
            self._log.append({"service": service, "action": action, "params": params, "time": time.time()})
        host, port = self.target.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        path = request.full_path.rstrip("?") if request.query_string else request.path
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        conn.request(request.method, path, body=body, headers=headers)
        upstream = conn.getresponse()
        data = upstream.read()
        out_headers = [(k, v) for k, v in upstream.getheaders()
                       if k.lower() not in ("transfer-encoding", "connection", "content-length")]
        conn.close()
        if action == "TerminateInstanceInAutoScalingGroup" and self.faults.get("slow_remove_seconds"):
            time.sleep(self.faults["slow_remove_seconds"])
        return Response(data, status=upstream.status, headers=out_headers)(environ, start_response)
