// Command guess-env is a skeleton tool-use environment in Go: a vcpo.v1.Environment server with the gRPC
// health service the sampler checks, an optional bearer token and optional TLS. Copy it and replace the game.
//
// Generate the protocol's code from the repository's protos (protoc, protoc-gen-go and protoc-gen-go-grpc on
// PATH), fetch the modules, build and run (docs/environments/go.md):
//
//	go generate
//	go mod tidy
//	go build -o guess-env .
//	./guess-env --port 50070 [--max-calls 8] [--token-file FILE] [--tls-cert PEM --tls-key PEM]
//
// The game: the task hides a whole number (its payload_json {"target": 37}, else one derived from its
// task_id, 1 to 100) and the model calls the `guess` tool with {"number": 50} (register it with the `json`
// tool parser). Each answer says "higher", "lower" or "correct"; a correct guess ends the episode with
// reward 1 (register it with the scorer "environment"), and so does, with reward 0, the --max-calls-th guess.
// A mistake of the model (another tool, arguments that are not {"number": <whole number>}) is answered with
// an observation saying what was wrong, never with an error status: that would fail the whole group.
package main

//go:generate protoc -I ../../protos --go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative vcpo/v1/common.proto vcpo/v1/rollout.proto vcpo/v1/environment.proto

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"flag"
	"fmt"
	"hash/fnv"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	vcpov1 "github.com/vcpo-rl/vcpo-rl/examples/go/vcpo/v1"
)

const service = "vcpo.v1.Environment"

var guessTool = &vcpov1.ToolSchema{
	Name:                 "guess",
	Description:          "Guess the hidden whole number; the answer says higher, lower or correct.",
	ParametersJsonSchema: `{"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}`,
}

type session struct {
	target int64
	calls  int
}

// guessServer keeps each episode's state by session id. The sampler runs many sessions at once (a group's
// episodes side by side), so the map takes a lock; the calls of one session come one at a time.
type guessServer struct {
	vcpov1.UnimplementedEnvironmentServer
	maxCalls int
	mu       sync.Mutex
	sessions map[string]*session
}

func (s *guessServer) Reset(ctx context.Context, req *vcpov1.ResetRequest) (*vcpov1.ResetResponse, error) {
	target, err := targetOf(req.GetTask())
	if err != nil {
		// a task this environment cannot play is the submitter's mistake, not the model's: fail the group
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	s.mu.Lock()
	s.sessions[req.GetSessionId()] = &session{target: target}
	s.mu.Unlock()
	return &vcpov1.ResetResponse{Tools: []*vcpov1.ToolSchema{guessTool}}, nil
}

func (s *guessServer) Step(ctx context.Context, req *vcpov1.StepRequest) (*vcpov1.StepResponse, error) {
	// a tool that takes a while should give up when ctx is done: the sampler's deadline has passed
	s.mu.Lock()
	defer s.mu.Unlock()
	sess, ok := s.sessions[req.GetSessionId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "unknown session %q", req.GetSessionId())
	}
	sess.calls++
	text, solved := answer(req.GetAction(), sess.target)
	reply := &vcpov1.StepResponse{Observation: &vcpov1.Observation{Text: text}}
	if solved {
		reply.Reward = 1
	}
	reply.Done = solved || sess.calls >= s.maxCalls
	return reply, nil
}

func (s *guessServer) Close(ctx context.Context, req *vcpov1.CloseRequest) (*vcpov1.CloseResponse, error) {
	// Close may name a session whose Reset failed or never came: nothing to drop is not an error
	s.mu.Lock()
	delete(s.sessions, req.GetSessionId())
	s.mu.Unlock()
	return &vcpov1.CloseResponse{}, nil
}

// targetOf reads the hidden number from the task: payload_json {"target": n}, else one from the task id.
func targetOf(task *vcpov1.Task) (int64, error) {
	if task.GetPayloadJson() == "" {
		h := fnv.New32a()
		h.Write([]byte(task.GetTaskId()))
		return int64(h.Sum32()%100) + 1, nil
	}
	var payload struct {
		Target *int64 `json:"target"`
	}
	if err := json.Unmarshal([]byte(task.GetPayloadJson()), &payload); err != nil || payload.Target == nil {
		return 0, fmt.Errorf("task %q: payload_json must be {\"target\": <whole number>}", task.GetTaskId())
	}
	return *payload.Target, nil
}

// answer is the observation for one call, and whether it found the number.
func answer(action *vcpov1.Action, target int64) (string, bool) {
	if action.GetToolName() == "" {
		return `error: no tool call could be read; call it as <tool_call>{"name": "guess", "arguments": {"number": 50}}</tool_call>`, false
	}
	if action.GetToolName() != guessTool.Name {
		return fmt.Sprintf("error: unknown tool %q; the tool is %q", action.GetToolName(), guessTool.Name), false
	}
	var args struct {
		Number *int64 `json:"number"`
	}
	if err := json.Unmarshal([]byte(action.GetArgumentsJson()), &args); err != nil || args.Number == nil {
		return `error: the arguments must be {"number": <whole number>}`, false
	}
	switch {
	case *args.Number < target:
		return "higher", false
	case *args.Number > target:
		return "lower", false
	}
	return "correct", true
}

// requireToken refuses the Environment calls that lack "authorization: Bearer <token>" metadata. Health stays
// open (the sampler sends the token there too, so checking it would also work).
func requireToken(token string) grpc.UnaryServerInterceptor {
	want := []byte("Bearer " + token)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		if !strings.HasPrefix(info.FullMethod, "/"+service+"/") {
			return next(ctx, req)
		}
		md, _ := metadata.FromIncomingContext(ctx)
		sent := md.Get("authorization")
		if len(sent) != 1 || subtle.ConstantTimeCompare([]byte(sent[0]), want) != 1 {
			return nil, status.Error(codes.Unauthenticated, "no authorization metadata or a wrong token")
		}
		return next(ctx, req)
	}
}

func main() {
	host := flag.String("host", "127.0.0.1", "address to listen on")
	port := flag.Int("port", 50070, "port to listen on (0: a free one)")
	maxCalls := flag.Int("max-calls", 8, "guesses per episode; the last one ends it")
	tokenFile := flag.String("token-file", "", "require \"authorization: Bearer <the file's token>\" (register it as auth_token)")
	tlsCert := flag.String("tls-cert", "", "PEM certificate chain: serve TLS (register it with tls = true)")
	tlsKey := flag.String("tls-key", "", "PEM private key of --tls-cert")
	flag.Parse()

	var options []grpc.ServerOption
	if *tokenFile != "" {
		raw, err := os.ReadFile(*tokenFile)
		token := strings.TrimSpace(string(raw))
		if err != nil || token == "" {
			fail("--token-file %s: no token in it (%v)", *tokenFile, err)
		}
		options = append(options, grpc.UnaryInterceptor(requireToken(token)))
	}
	if (*tlsCert == "") != (*tlsKey == "") {
		fail("--tls-cert and --tls-key go together")
	}
	if *tlsCert != "" {
		creds, err := credentials.NewServerTLSFromFile(*tlsCert, *tlsKey)
		if err != nil {
			fail("TLS: %v", err)
		}
		options = append(options, grpc.Creds(creds))
	}
	server := grpc.NewServer(options...)
	vcpov1.RegisterEnvironmentServer(server, &guessServer{maxCalls: *maxCalls, sessions: map[string]*session{}})
	// the sampler checks health when the environment is registered: SERVING for the service and the server
	healthServer := health.NewServer()
	healthServer.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	healthServer.SetServingStatus(service, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(server, healthServer)

	listener, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		fail("cannot listen on %s:%d: %v", *host, *port, err)
	}
	fmt.Printf("listening on %s:%d\n", *host, listener.Addr().(*net.TCPAddr).Port)

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		<-stop
		healthServer.Shutdown() // NOT_SERVING from now on
		timer := time.AfterFunc(2*time.Second, server.Stop)
		server.GracefulStop() // lets the calls in flight finish, for at most the 2 s above
		timer.Stop()
	}()
	if err := server.Serve(listener); err != nil {
		fail("%v", err)
	}
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "guess-env: "+format+"\n", args...)
	os.Exit(1)
}
